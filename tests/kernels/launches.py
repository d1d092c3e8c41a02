"""What a Triton launcher asked for, seen from the CPU: the grid and arguments of each launch
(under the interpreter), how many `tl.dot`s the interpreted programs ran, and the PTX that
compiled Triton emits for sm_90 for such a launch (no GPU needed to compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch


@dataclass
class Launch:
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def programs(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n


@dataclass
class _Recorder:
    kernel: Any
    launches: list[Launch] = field(default_factory=list)

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.launches.append(Launch(tuple(grid), args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def record_launches(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Launch]:
    """Launches of kernel `module.name` from now on (the launchers look it up at each call)."""
    recorder = _Recorder(getattr(module, name))
    monkeypatch.setattr(module, name, recorder)
    return recorder.launches


def count_dots(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-element list counting the `tl.dot`s that interpreted programs run from now on."""
    from triton.runtime import interpreter

    count = [0]
    create_dot = interpreter.InterpreterBuilder.create_dot

    def counting(self: Any, *args: Any) -> Any:
        count[0] += 1
        return create_dot(self, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", counting)
    return count


_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                 torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"}


def sm90_ptx(kernels: list[tuple[str, str, Launch]]) -> list[str]:
    """PTX of each (module, kernel name, recorded launch) compiled for sm_90 with the launch's
    argument types and constexprs, in one child process (the interpreter must be off there)."""
    jobs = [{"module": module, "name": name, "constexprs": launch.kwargs,
             "types": [("*" + _TRITON_TYPES[v.dtype]) if isinstance(v, torch.Tensor)
                       else "fp32" if isinstance(v, float) else "i32" for v in launch.args]}
            for module, name, launch in kernels]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = json.dumps([p for p in sys.path if p])  # the child imports the same triton as here
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(jobs), path], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"compiling for sm_90 failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


_COMPILE = """
import importlib, json, sys
sys.path[:0] = json.loads(sys.argv[2])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
positional = tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7)  # constexpr keys
ptx = []
for job in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module(job["module"]), job["name"])
    names = list(fn.arg_names)
    signature = dict(zip(names, job["types"]))
    signature.update((k, "constexpr") for k in job["constexprs"])
    constexprs = job["constexprs"]
    if positional:
        constexprs = {(names.index(k),): v for k, v in constexprs.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    ptx.append(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
print(json.dumps(ptx))
"""
