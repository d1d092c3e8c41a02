"""Omnibus beside llama.cpp's server on the same GGUF file and workload
(`make bench-llamacpp`, docs/benchmarks/llamacpp.md; not part of `make test`).

Both serve SmolLM2-135M-Instruct's Q4_1 file over their OpenAI-compatible
/v1/completions on loopback: llama.cpp's `llama-server` (built from the llama.cpp that
llama-cpp-python's sdist vendors; 2 threads, 16 parallel slots) and Omnibus's router and
engine (`--quantization auto`: the file's Q4_1 blocks on the INT4 CPU kernel). The same
requests go to each, one server at a time: PROMPTS one after another (batch 1), then all
at once 16 in flight; greedy, ignore_eos, `--tokens` output tokens each (checked in every
reply's usage). Output tok/s is all output tokens over the wall time of the phase.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from omnibus.bench.quant import PROMPTS, smollm2_path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def complete(client: httpx.AsyncClient, url: str, prompt: str, tokens: int, model: str) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    reply = await client.post(url, json=body, timeout=600)
    reply.raise_for_status()
    got = reply.json()["usage"]["completion_tokens"]
    if got != tokens:
        raise RuntimeError(f"{url} returned {got} tokens, not {tokens}")
    return got


async def phase(url: str, prompts: list[str], tokens: int, concurrency: int, model: str) -> float:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        await complete(client, url, "warm up", 4, model)

        async def one(p: str) -> int:
            async with sem:
                return await complete(client, url, p, tokens, model)

        start = time.perf_counter()
        done = await asyncio.gather(*(one(p) for p in prompts))
        return sum(done) / (time.perf_counter() - start)


def wait_http(url: str, what: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not serve {url} within {seconds} s")


def run_llamacpp(server: Path, gguf: Path, tokens: int, threads: int) -> dict[str, float]:
    port = free_port()
    cmd = [str(server), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", "16",
           "-c", str(16 * (tokens + 64)), "--port", str(port), "--host", "127.0.0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", "llama-server", proc)
        return measure(f"http://127.0.0.1:{port}/v1/completions", tokens, "smollm2")
    finally:
        proc.terminate()
        proc.wait(30)


def run_omnibus(gguf: Path, tokens: int) -> dict[str, float]:
    engine_port, router_port, http = free_port(), free_port(), free_port()
    py = sys.executable
    engine = subprocess.Popen([py, "-m", "omnibus.engine", "serve", "--model", str(gguf), "--port", str(engine_port),
                               "--max-num-seqs", "16"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    router = subprocess.Popen([py, "-m", "omnibus.router", "serve", "--model", str(gguf), "--port", str(router_port),
                               "--engine", f"127.0.0.1:{engine_port}", "--http-port", str(http),
                               "--model-name", "smollm2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{http}/health", "omnibus", router)
        url = f"http://127.0.0.1:{http}/v1/completions"
        deadline = time.monotonic() + 300
        while True:  # /health answers before the engine has reported in
            try:
                asyncio.run(phase(url, [PROMPTS[0]], 1, 1, "smollm2"))
                break
            except httpx.HTTPStatusError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        return measure(url, tokens, "smollm2")
    finally:
        for proc in (router, engine):
            proc.terminate()
            proc.wait(30)


def measure(url: str, tokens: int, model: str) -> dict[str, float]:
    return {"batch 1": asyncio.run(phase(url, PROMPTS[:8], tokens, 1, model)),
            "16 concurrent": asyncio.run(phase(url, PROMPTS[:16] * 2, tokens, 16, model))}


def report(rows: dict[str, dict[str, float]], tokens: int, threads: int, server: Path) -> str:
    phases = list(next(iter(rows.values())))
    lines = ["# Omnibus and llama.cpp's server on one GGUF file", "",
             f"`make bench-llamacpp`: SmolLM2-135M-Instruct Q4_1, /v1/completions on loopback, greedy, "
             f"ignore_eos, {tokens} output tokens per request; batch 1: 8 requests one after another; "
             f"16 concurrent: 32 requests, 16 in flight. {threads} threads each. llama.cpp: `{server.name}` "
             "built from llama-cpp-python 0.3.36's vendored llama.cpp (`-np 16`).", "",
             "| server | " + " | ".join(f"{p} tok/s" for p in phases) + " |",
             "|---|" + "---|" * len(phases)]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[p]:.1f}" for p in phases) + " |")
    omni, llama = rows["omnibus"], rows["llama.cpp"]
    lines.append("| omnibus ÷ llama.cpp | " + " | ".join(f"{omni[p] / llama[p]:.2f}" for p in phases) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", type=Path, required=True, help="llama-server binary")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    gguf = smollm2_path()
    rows = {"llama.cpp": run_llamacpp(args.server, gguf, args.tokens, args.threads)}
    print("llama.cpp", rows["llama.cpp"], flush=True)
    rows["omnibus"] = run_omnibus(gguf, args.tokens)
    print("omnibus", rows["omnibus"], flush=True)
    text = report(rows, args.tokens, args.threads, args.server)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
