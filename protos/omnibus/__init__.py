"""Omnibus: multi-tenant LLM serving, a gRPC router in front of continuous-batching engines.

Subpackages (each a layer; nothing imports upward):

- ``omnibus.v1``: the generated gRPC/protobuf code of ``protos/omnibus/v1/*.proto``.
- ``omnibus.common``: torch-free rules both sides import (sampling limits, adapter names,
  gRPC server bootstrap, logging, metric buckets).
- ``omnibus.router``: the stateless router (torch-free).
- ``omnibus.engine``: the engine worker (needs the ``[engine]`` extra: torch, safetensors).
- ``omnibus.kernels``: paged attention, multi-LoRA and fused ops, torch references + Triton.
- ``omnibus.bench``: benchmarks and the load generator.
"""

__version__ = "0.2.0"
