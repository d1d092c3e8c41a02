"""Structured output's host cost, per grammar engine: compile time and the time to fill
one request's token mask (what the engine pays per structured row per step), with
xgrammar (the engine's) beside llguidance (vLLM's and llama.cpp's other choice), on
byte-level BPE tokenizers of 2,048 and 32,000 ids (bench-host's size and Llama 2's).

    make bench-grammar            # python -m omnibus.bench.grammar --out docs/benchmarks/grammar.md

Each walk follows one output through the grammar: fill the mask, pick an allowed token
at random (seeded; the end token only when nothing else is allowed), consume it, and
start over when the grammar ends, for --tokens mask fills (each engine walks its own
random outputs of the same format). CPU only: both engines fill masks on the host.
xgrammar compiles ahead (a token-mask cache per grammar state, most of its compile
time); llguidance compiles almost nothing and parses lazily per token.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

# A schema of the shapes applications send: nested object, enum, bounded integers, an
# array of strings with a pattern, optional fields.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z ]{1,12}$"},
    "kind": {"enum": ["fox", "dog", "owl", "cat"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "maxItems": 4},
    "home": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,16}$"},
                                              "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
             "required": ["city"], "additionalProperties": False},
    "ok": {"type": "boolean"}},
    "required": ["name", "kind", "age", "ok"], "additionalProperties": False}
FORMATS = {"schema": json.dumps(SCHEMA), "json_object": '{"type": "object"}'}
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
STOP = 2  # "</s>", the end token of bench-host's tokenizer (ids 0-2: <unk>, <s>, </s>)


def tokenizer(folder: Path, vocab_size: int) -> Path:
    """bench-host's byte-level BPE tokenizer of `vocab_size` ids, trained here on synthetic
    words, numbers and JSON punctuation (varied enough to reach 32,000 merges); returns its
    folder."""
    from omnibus.bench.host import build_tokenizer

    rng = random.Random(0)
    words = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(60_000)]
    corpus = [json.dumps({rng.choice(words): rng.choice(words), "n": rng.randint(0, 10**rng.randint(1, 6)),
                          "l": rng.sample(words, 3)}) + " " + " ".join(rng.sample(words, 12))
              for _ in range(40_000)]
    path = folder / f"tokenizer-{vocab_size}"
    build_tokenizer(path, vocab_size, corpus)
    return path


class XGrammar:
    name = "xgrammar"

    def __init__(self, path: Path, vocab: int) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[STOP])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema: str, strict: bool) -> object:
        return self.compiler.compile_json_schema(schema, strict_mode=strict, max_whitespace_cnt=1)

    def matcher(self, compiled: object) -> object:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher) -> torch.Tensor:
        matcher.fill_next_token_bitmask(self.mask)
        return self.mask[0]

    def consume(self, matcher, token: int) -> bool:
        """False when the output has ended."""
        assert matcher.accept_token(token)
        return not matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, path: Path, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        from transformers import PreTrainedTokenizerFast

        self.ll = llguidance
        hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=STOP)
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, schema: str, strict: bool) -> object:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        self.ll.LLMatcher.validate_grammar(grammar, self.tokenizer)  # what compiling costs here
        return grammar

    def matcher(self, compiled: object) -> object:
        return self.ll.LLMatcher(self.tokenizer, compiled)

    def fill(self, matcher) -> torch.Tensor:
        self.ll.torch.fill_next_token_bitmask(matcher, self.mask, 0)
        return self.mask[0]

    def consume(self, matcher, token: int) -> bool:
        assert matcher.consume_token(token), matcher.get_error()
        return not matcher.is_stopped()


def allowed(row: torch.Tensor, vocab: int) -> list[int]:
    """The token ids a packed bitmask row (int32 words, bit j of word i: id 32 i + j) allows."""
    bits = ((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def walk(engine, compiled, vocab: int, fills: int, seed: int) -> list[float]:
    """`fills` mask fills along random outputs: each fill's µs."""
    rng = random.Random(seed)
    times = []
    matcher = engine.matcher(compiled)
    while len(times) < fills:
        t0 = time.perf_counter()
        row = engine.fill(matcher)
        times.append((time.perf_counter() - t0) * 1e6)
        ids = allowed(row, vocab)
        choices = [t for t in ids if t != STOP] or ids
        if not engine.consume(matcher, rng.choice(choices)):
            matcher = engine.matcher(compiled)
    return times


def measure(vocab_sizes: list[int], fills: int) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in vocab_sizes:
            path = tokenizer(Path(tmp), size)
            from tokenizers import Tokenizer

            vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
            for fmt, schema in FORMATS.items():
                for cls in (XGrammar, LLGuidance):
                    engine = cls(path, vocab)
                    t0 = time.perf_counter()
                    compiled = engine.compile(schema, strict=fmt == "schema")
                    compile_ms = (time.perf_counter() - t0) * 1e3
                    times = walk(engine, compiled, vocab, fills, seed=size)
                    rows.append({"engine": cls.name, "vocab": vocab, "format": fmt,
                                 "compile_ms": compile_ms, "fills": len(times),
                                 "fill_us_median": statistics.median(times),
                                 "fill_us_p99": sorted(times)[int(0.99 * (len(times) - 1))]})
    return {"rows": rows, "fills": fills, "host": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(), "versions": _versions()}


def _versions() -> dict:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("xgrammar", "llguidance", "tokenizers")}


def markdown(result: dict) -> str:
    lines = [
        "# Structured output: grammar engines on the host",
        "",
        "Written by `make bench-grammar` (bench/omnibus/bench/grammar.py) on this project's 2-core "
        "CPU VM (no GPU: both engines fill masks on the host in any case). Byte-level BPE tokenizers "
        "trained on synthetic text; one output at a time, random allowed tokens (seeded), "
        f"{result['fills']} mask fills per row. Versions: "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items()) + ".",
        "",
        "| engine | vocab | format | compile ms | mask fill µs, median | p99 |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['engine']} | {r['vocab']:,} | {r['format']} | {r['compile_ms']:.1f} | "
                     f"{r['fill_us_median']:.1f} | {r['fill_us_p99']:.1f} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[2048, 32000])
    ap.add_argument("--tokens", type=int, default=400, help="mask fills per row")
    ap.add_argument("--out", type=Path, help="markdown report (the JSON beside it)")
    args = ap.parse_args(argv)
    result = measure(args.vocab, args.tokens)
    text = markdown(result)
    print(text)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        notes = ""
        if args.out.exists() and "\n## Notes" in (old := args.out.read_text()):
            notes = old[old.index("\n## Notes"):]
        args.out.write_text(text + notes)


if __name__ == "__main__":
    main()
