"""Structured output: grammars compiled from the model's tokenizer, one matcher per
request, and the token mask applied to its logits before sampling (xgrammar, the
grammar engine vLLM, SGLang and TensorRT-LLM use).

`Grammars` is built on the first structured request (importing xgrammar and reading
tokenizer.json cost a request without a grammar nothing). It compiles each format once
(xgrammar's compiler caches compiled grammars by their text) and makes a
`GrammarMatcher` for each request. The scheduler advances a request's matcher with every
token it emits (engine/omnibus/engine/core/bookkeeping.py), so a preemption, which recomputes tokens
without emitting any, leaves it where it was. Before each sampling, `mask_logits` fills
one bitmask row per structured row and sets the logits of the tokens the grammar does not
allow to -inf; rows of other requests are untouched.

Formats (omnibus.common.sampling.StructuredOutput): a JSON schema, any JSON object, a
regular expression, a choice of strings (an EBNF alternation of their exact text) and a
grammar: EBNF (xgrammar's GBNF dialect, rule `root`) when it has a `::=`, else Lark,
converted to EBNF first (engine/omnibus/engine/worker/lark.py), as vLLM does. A JSON
schema is converted to EBNF too (engine/omnibus/engine/worker/json_schema.py), around
what xgrammar's converter gets wrong, so every output is strict JSON the schema accepts.

The engine never tokenizes text here: the tokenizer is read only for its vocabulary
(each token's bytes), which the grammar engine needs to know which tokens fit.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
from tokenizers import Tokenizer

from omnibus.common.model_files import open_model
from omnibus.common.sampling import StructuredOutput
from omnibus.engine.worker.json_schema import UnservableSchema, json_schema_ebnf
from omnibus.engine.worker.lark import ebnf_literal, is_lark, lark_to_ebnf

log = structlog.get_logger(__name__)

# Compiled grammars kept for reuse (xgrammar's cache, least recently used out beyond it).
CACHE_BYTES = 256 << 20
# OpenAI's json_object: one JSON object with any keys (strict mode off, or it would allow
# only the properties the schema names: none).
_ANY_OBJECT = '{"type": "object"}'
# What each kind is called in a refusal.
_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object format", "regex": "regular expression",
          "choice": "choice", "grammar": "EBNF grammar"}


class Grammars:
    """Compiles structured-output formats for one model's vocabulary."""

    def __init__(self, model: str | Path, vocab_size: int, eos_token_ids: Sequence[int],
                 max_whitespace: int) -> None:
        """`model`: the model directory or GGUF file; `vocab_size`: the model's (its
        logits' width, which may exceed the tokenizer's); `eos_token_ids`: what ends a
        complete output (the model's end-of-sequence ids); `max_whitespace`: whitespace
        characters between two JSON elements at most."""
        try:
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast
        except ImportError as exc:  # a deployment without the engine extra's xgrammar
            raise RuntimeError(f"structured output needs xgrammar (pip install 'omnibus[engine]'): {exc}") from exc

        try:  # a model directory's tokenizer.json, or the one a GGUF file's metadata makes
            text = open_model(model).tokenizer_json()
        except ValueError as exc:
            raise ValueError(f"structured output needs the model's tokenizer: {exc}") from exc
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(text))
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None)
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
        self.vocab_size = vocab_size
        self.max_whitespace = max_whitespace
        self._bitmask: torch.Tensor | None = None  # (rows, ceil(V / 32)) int32, grown as needed
        self._probe: torch.Tensor | None = None  # (1, ceil(V / 32)): a new matcher's first mask
        self._stop_row = _bits(info.stop_token_ids, vocab_size)  # (ceil(V / 32),): the stop tokens
        log.info("grammar_compiler_ready", vocab_size=vocab_size, vocab_type=info.vocab_type.name,
                 stop_token_ids=info.stop_token_ids)

    def compile(self, fmt: StructuredOutput) -> Any:
        """The compiled grammar of `fmt`. xgrammar's compiler caches each by its kind and
        text (a regex and an EBNF grammar of the same text are different entries; a JSON
        schema by its EBNF), so a format compiles once while it stays in CACHE_BYTES.
        ValueError naming structured_output when the grammar engine refuses it, or when
        it would hold outputs to a JSON schema wrongly."""
        ebnf = lark_to_ebnf(fmt.schema) if _is_lark(fmt) else fmt.schema  # refuses Lark it cannot convert
        try:
            return self._compile(fmt, ebnf)
        except UnservableSchema as exc:  # says what is wrong and what to write instead
            raise ValueError(f"structured_output: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError for a bad format
            what = "Lark grammar, converted to EBNF," if _is_lark(fmt) else _NAMES[fmt.kind]
            raise ValueError(f"structured_output: the {what} does not compile: {_first_line(exc)}") from None

    def _compile(self, fmt: StructuredOutput, ebnf: str) -> Any:
        ws = self.max_whitespace
        if fmt.kind == "json_object":
            return self._compiler.compile_grammar(json_schema_ebnf(_ANY_OBJECT, ws, strict=False))
        if fmt.kind == "json_schema":
            return self._compiler.compile_grammar(json_schema_ebnf(fmt.schema, ws))
        if fmt.kind == "regex":
            return self._compiler.compile_regex(fmt.schema)
        if fmt.kind == "choice":
            return self._compiler.compile_grammar(choice_grammar(fmt.options))
        return self._compiler.compile_grammar(ebnf)  # "grammar": EBNF, rule root

    def matcher(self, fmt: StructuredOutput, emitted: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher for one request, advanced past `emitted` (a continuation's
        output so far). ValueError when the format does not compile or `emitted` breaks it."""
        matcher = GrammarMatcher(self._xgr.GrammarMatcher(self.compile(fmt)))
        for i, token in enumerate(emitted):
            if matcher.advance(token):
                raise ValueError(
                    f"structured_output: output token {i} of the continuation ({token}) "
                    "ends or breaks the format")
        if not self._any_allowed(matcher):
            where = "follow the continuation's output" if emitted else "start the output"
            hint = " (does every rule it needs reach a string?)" if fmt.kind == "grammar" else ""
            raise ValueError(f"structured_output: no token can {where} under this {_name(fmt)}{hint}")
        return matcher

    def _any_allowed(self, matcher: GrammarMatcher) -> bool:
        """Whether some token fits next. A grammar with no sentence (`root ::= root`)
        compiles, and would mask every logit: the request would emit a token it forbids."""
        if self._probe is None:
            self._probe = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill(self._probe, 0)
        return bool(self._probe.any())

    def fill(self, num_rows: int, rows: list[tuple[int, GrammarMatcher]]) -> GrammarMask:
        """The masks of a step with `num_rows` sampled rows: for each (r, matcher) in
        `rows`, the tokens row r's grammar allows next. Host work: the model runner does it
        while the device runs the forward."""
        bitmask = self._rows(num_rows)
        for r, m in rows:
            m.fill(bitmask, r)
        indices = [r for r, _ in rows]
        self._end_dead_ends(bitmask, indices)
        return GrammarMask(self, bitmask[:num_rows], indices)

    def _end_dead_ends(self, bitmask: torch.Tensor, indices: list[int]) -> None:
        """Lets a row whose grammar allows no token end: its stop tokens are allowed, and
        the request ends ("stop") with the one picked (a stop id, or a token its matcher
        refuses under ignore_eos). A grammar can reach
        a rule with no sentence mid-output (`root ::= "a" x`, `x ::= x`); with every
        logit masked the request would emit a token its grammar forbids."""
        dead = ~bitmask[indices].any(dim=1)
        if bool(dead.any()):
            for i in dead.nonzero().flatten().tolist():
                log.warning("grammar_dead_end", row=indices[i])
                bitmask[indices[i]] |= self._stop_row

    def _rows(self, n: int) -> torch.Tensor:
        """A bitmask of at least n rows (the rows used are refilled before each use)."""
        if self._bitmask is None or self._bitmask.shape[0] < n:
            rows = max(n, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]), 8)
            self._bitmask = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
        return self._bitmask


class GrammarMask:
    """A step's filled masks, to apply to its logits once they are computed."""

    __slots__ = ("_grammars", "_bitmask", "_indices")

    def __init__(self, grammars: Grammars, bitmask: torch.Tensor, indices: list[int]) -> None:
        self._grammars, self._bitmask, self._indices = grammars, bitmask, indices

    def apply(self, logits: torch.Tensor) -> None:
        """Sets to -inf, in place, the logits (S, V) of the tokens each masked row's grammar
        does not allow; other rows are untouched."""
        bitmask = self._bitmask
        if logits.device.type != "cpu":
            # A pageable copy: the host may refill the buffer as soon as this returns.
            bitmask = bitmask.to(logits.device)
        self._grammars._xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self._grammars.vocab_size, indices=self._indices)


class GrammarMatcher:
    """One request's place in its grammar (core's TokenGrammar). Only the step loop
    touches it."""

    __slots__ = ("_m",)

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def advance(self, token: int) -> bool:
        """Takes an emitted token; True when the request ends with it: the grammar has
        accepted its end (a stop token after a complete output), or the token does not fit
        (only a continuation's earlier output can: sampled tokens are masked)."""
        if not self._m.accept_token(token):
            log.warning("grammar_rejected_token", token=token)
            return True
        return bool(self._m.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into bitmask row `row` (on the host)."""
        self._m.fill_next_token_bitmask(bitmask, row)


def _bits(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """A bitmask row (xgrammar's layout: token t is bit t % 32 of int32 word t // 32)
    allowing `token_ids`."""
    row = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    for t in token_ids:
        bit = t % 32
        row[t // 32] |= (1 << bit) if bit < 31 else -(1 << 31)  # bit 31 is the sign bit
    return row


def choice_grammar(options: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly `options`: `root ::= "a" | "b"`, each
    option a string literal of its exact text."""
    return "root ::= " + " | ".join(ebnf_literal(o) for o in options)


def _is_lark(fmt: StructuredOutput) -> bool:
    return fmt.kind == "grammar" and is_lark(fmt.schema)


def _name(fmt: StructuredOutput) -> str:
    """What `fmt`'s kind is called in a refusal."""
    return "Lark grammar" if _is_lark(fmt) else _NAMES[fmt.kind]


def _first_line(exc: BaseException) -> str:
    """xgrammar's reason, without its log prefix ("[05:05:18] /project/cpp/x.cc:4944: ")."""
    text = str(exc).strip() or type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text.splitlines()[0])[:500]

