"""Checkpoint formats: readers that turn a file's tensors into the weights of
`omnibus.engine.model.quant.weights`.

A quantized safetensors checkpoint says how it is packed in config.json's
`quantization_config`; `decoder_for` picks the reader by its `quant_method`. Each reader
is `decode(tensors, quantization_config, model_config)`: it takes the file's
(name, tensor) pairs and yields (name, tensor or decoded weight) pairs for the loader:
`formats.compressed_tensors` (llm-compressor's "compressed-tensors") and `formats.gptq`
("gptq", "awq"). GGUF files have their own reader (`formats.gguf`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from omnibus.engine.config import ModelConfig, ModelLoadError
from omnibus.engine.model.quant.weights import Weight

Decoder = Callable[[Iterator[tuple[str, torch.Tensor]], dict[str, Any], ModelConfig],
                   Iterator[tuple[str, "torch.Tensor | Weight"]]]


def _decoders() -> dict[str, Decoder]:
    from omnibus.engine.model.formats import compressed_tensors, gptq

    return {"compressed-tensors": compressed_tensors.decode, "gptq": gptq.decode_gptq, "awq": gptq.decode_awq}


def decoder_for(qconfig: dict[str, Any], path: Path) -> Decoder:
    method = qconfig.get("quant_method")
    decoders = _decoders()
    if method not in decoders:
        served = ", ".join(sorted(decoders)) or "none yet"
        raise ModelLoadError(f"{path / 'config.json'}: quantization_config.quant_method {method!r} is not served "
                             f"(served: {served})")
    return decoders[method]
