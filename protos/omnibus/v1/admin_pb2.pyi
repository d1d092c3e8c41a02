from omnibus.v1 import engine_pb2 as _engine_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdminAdapterRequest(_message.Message):
    __slots__ = ("adapter", "engines")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    engines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter: _Optional[str] = ..., engines: _Optional[_Iterable[str]] = ...) -> None: ...

class AdminEngineResult(_message.Message):
    __slots__ = ("engine", "resident", "was_loaded")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    WAS_LOADED_FIELD_NUMBER: _ClassVar[int]
    engine: str
    resident: bool
    was_loaded: bool
    def __init__(self, engine: _Optional[str] = ..., resident: _Optional[bool] = ..., was_loaded: _Optional[bool] = ...) -> None: ...

class AdminAdapterResponse(_message.Message):
    __slots__ = ("adapter", "engines")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    engines: _containers.RepeatedCompositeFieldContainer[AdminEngineResult]
    def __init__(self, adapter: _Optional[str] = ..., engines: _Optional[_Iterable[_Union[AdminEngineResult, _Mapping]]] = ...) -> None: ...

class AdminListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdminEngineAdapters(_message.Message):
    __slots__ = ("engine", "reachable", "error", "resident", "cached", "available", "max_loras", "residency")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    engine: str
    reachable: bool
    error: str
    resident: _containers.RepeatedScalarFieldContainer[str]
    cached: _containers.RepeatedScalarFieldContainer[str]
    available: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    residency: _containers.RepeatedCompositeFieldContainer[_engine_pb2.AdapterResidency]
    def __init__(self, engine: _Optional[str] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ..., resident: _Optional[_Iterable[str]] = ..., cached: _Optional[_Iterable[str]] = ..., available: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ..., residency: _Optional[_Iterable[_Union[_engine_pb2.AdapterResidency, _Mapping]]] = ...) -> None: ...

class AdminListAdaptersResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[AdminEngineAdapters]
    def __init__(self, engines: _Optional[_Iterable[_Union[AdminEngineAdapters, _Mapping]]] = ...) -> None: ...
