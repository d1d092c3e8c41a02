"""Multi-LoRA: the one owner of adapter lifecycle (see manager.py for the interface).

adapters.py  names, the confined adapter root, adapter_config.json, weight files
slots.py     the device tier: stacked slot tensors, pins, targeted slot fills
batch.py     LoraBatch: one step's adapter segments, applied per projection
host.py      HostTier: the host tier, its loader thread, which adapters it keeps
manager.py   LoraManager: the verbs; device slot pins, load/unload policy, admission gate
"""

from omnibus.engine.lora.adapters import (
    AdapterError,
    AdapterLoadError,
    AdapterStateError,
    UnknownAdapterError,
    list_adapter_names,
    resolve_adapter_dir,
)
from omnibus.engine.lora.batch import LoraBatch
from omnibus.engine.lora.manager import AdapterInventory, Gate, LoraConfig, LoraManager, LoraStats

__all__ = [
    "AdapterError", "AdapterInventory", "AdapterLoadError", "AdapterStateError", "Gate", "LoraBatch",
    "LoraConfig", "LoraManager", "LoraStats", "UnknownAdapterError", "list_adapter_names",
    "resolve_adapter_dir",
]
