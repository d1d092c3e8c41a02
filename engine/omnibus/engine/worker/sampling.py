"""Token sampling: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

One `Sampler` call picks one token for every row of a (B, V) logits batch. Per row:

1. Penalties on the raw logits: repetition (HF semantics, over prompt + output), then
   presence / frequency (OpenAI semantics, over output only).
2. Returned logprobs are `log_softmax` of the penalized logits, taken *before*
   temperature, top-k, top-p and min-p. They describe the model's (penalized)
   distribution, not the truncated one the token was drawn from, which is what the
   OpenAI API reports and what stays comparable across sampling settings.
3. Greedy rows (temperature 0) take the argmax of the penalized logits.
4. Sampled rows divide by temperature, apply top-k, then top-p on the top-k
   survivors, then min-p, and draw from the softmax of what is left.

Draws use the exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d. per token
picks token i with probability probs[i]. The noise is drawn per row: a seeded request's
(V,) block for output position i comes from a generator seeded with a hash of
(seed, i) (`SeededDraws`), so its tokens depend only on its seed, the position and its
logits: never on what else is in the batch, and a request resumed at position k from
its first k tokens (a continuation on another engine, `output_offset`) draws what the
uninterrupted run would have. Unseeded rows share the Sampler's generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnibus.common.sampling import MAX_LOGPROBS, SamplingParams, check_seed
from omnibus.engine.core.sequence import SamplerOutput, TokenLogprobs
from omnibus.engine.worker.transfer import to_device

__all__ = [
    "MAX_LOGPROBS",
    "SamplingParams",
    "TokenLogprobs",
    "SamplerOutput",
    "SampledBatch",
    "PromptRows",
    "PromptLogprobBatch",
    "prompt_logprobs",
    "Sampler",
    "SeededDraws",
    "allowed_tokens",
    "apply_logit_bias",
    "apply_penalties",
    "make_generator",
]

# Above this k a full sort is cheaper than torch.topk for the top-k threshold.
_TOPK_MAX = 1024
_F32_MAX = torch.finfo(torch.float32).max


@dataclass
class SampledBatch:
    """One Sampler call's picks, still where they were computed. `to_host` starts the
    device-to-host copy without waiting; `output` reads it (waiting only then)."""

    tokens: torch.Tensor  # (B,) int64
    logprob_rows: list[int] = field(default_factory=list)  # rows that asked for logprobs
    widths: list[int] = field(default_factory=list)  # top-n asked, per logprob row
    chosen: torch.Tensor | None = None  # (n,) float32 logprob of each row's pick
    top_ids: torch.Tensor | None = None  # (n, w) int64, highest first
    top_vals: torch.Tensor | None = None  # (n, w) float32
    ready: torch.cuda.Event | None = None  # recorded after the copies, on CUDA
    prompt: PromptLogprobBatch | None = None  # the step's prompt logprobs, when it scored any

    def to_host(self) -> SampledBatch:
        if not self.tokens.is_cuda:
            return self
        def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)
        out = SampledBatch(pinned(self.tokens), self.logprob_rows, self.widths, pinned(self.chosen),
                           pinned(self.top_ids), pinned(self.top_vals), torch.cuda.Event())
        if self.prompt is not None:
            p = self.prompt
            out.prompt = PromptLogprobBatch(pinned(p.chosen), pinned(p.top_ids), pinned(p.top_vals),
                                            p.spans)
        out.ready.record()
        return out

    def output(self) -> SamplerOutput:
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        if self.logprob_rows:
            top_ids, top_vals = self.top_ids.tolist(), self.top_vals.tolist()
            for j, (i, val) in enumerate(zip(self.logprob_rows, self.chosen.tolist())):
                n = self.widths[j]
                logprobs[i] = TokenLogprobs(tokens[i], val, tuple(zip(top_ids[j][:n], top_vals[j][:n])))
        out = SamplerOutput(tokens, logprobs)
        if self.prompt is not None:
            out.prompt_logprobs = self.prompt.output()
        return out


@dataclass
class PromptRows:
    """The rows of a step whose logits score prompt tokens (prompt logprobs), as the
    model runner's prepare() lays them out."""

    index: torch.Tensor  # (R,) int64: rows of the step's hidden states, in span order
    targets: torch.Tensor  # (R,) int64: the prompt token each row scores (the next one)
    # (sequence, position of its first row, its rows, top-n it asked for), one per sequence
    spans: list[tuple[Any, int, int, int]]


@dataclass
class PromptLogprobBatch:
    """The logprobs of a step's scored prompt tokens, still where they were computed."""

    chosen: torch.Tensor  # (R,) float32: each prompt token's logprob
    top_ids: torch.Tensor  # (R, w) int64, most likely first
    top_vals: torch.Tensor  # (R, w) float32
    spans: list[tuple[Any, int, int, int]]  # PromptRows.spans

    def output(self) -> dict[Any, tuple[int, list[TokenLogprobs]]]:
        """sequence -> (position of its first row, TokenLogprobs per row); reads the host copy."""
        chosen, ids, vals = self.chosen.tolist(), self.top_ids.tolist(), self.top_vals.tolist()
        out: dict[Any, tuple[int, list[TokenLogprobs]]] = {}
        row = 0  # the row at position p scores prompt token p + 1
        for seq, first, count, width in self.spans:
            tokens = seq.prompt_token_ids
            out[seq] = (first, [
                TokenLogprobs(tokens[first + 1 + j], chosen[row + j],
                              tuple(zip(ids[row + j][:width], vals[row + j][:width])))
                for j in range(count)])
            row += count
        return out


def prompt_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    rows: PromptRows, chunk: int) -> PromptLogprobBatch:
    """Log-softmax of the raw logits (no penalties, temperature or truncation, as vLLM's
    prompt logprobs) at `rows` of `hidden` (T, H): each row's prompt token and the top
    n. `logits_of` maps (c, H) hidden states to (c, V) float32 logits; rows go through
    it `chunk` at a time, so a long prompt never holds (R, V) logits at once."""
    width = max(span[3] for span in rows.spans)
    total = sum(span[2] for span in rows.spans)
    chosen, top_ids, top_vals = [], [], []
    for a in range(0, total, chunk):
        lp = logits_of(hidden.index_select(0, rows.index[a:a + chunk])).log_softmax(dim=-1)  # (c, V)
        chosen.append(lp.gather(1, rows.targets[a:a + chunk, None])[:, 0])
        top = lp.topk(min(width, lp.shape[1]), dim=-1)
        top_ids.append(top.indices)
        top_vals.append(top.values)
    return PromptLogprobBatch(torch.cat(chosen), torch.cat(top_ids), torch.cat(top_vals), rows.spans)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A bijective 64-bit mix (splitmix64's finalizer): nearby inputs, unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SeededDraws:
    """A seeded request's noise: the (V,) Exp(1) block for output position i comes from a
    generator seeded with a hash of (seed, i), so it depends on nothing else (not the
    batch, not how many draws came before on this engine). `position` is the next
    output position to draw for; each draw advances it by one."""

    def __init__(self, seed: int, device: str | torch.device = "cpu", position: int = 0) -> None:
        self.seed = check_seed(seed)
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"position must be an integer >= 0, got {position!r}")
        self.position = position
        self.device = torch.device(device)
        self._gen = torch.Generator(device=self.device)
        self._seed_hash = _splitmix64(self.seed)

    def draw(self, vocab: int) -> torch.Tensor:
        """(V,) Exp(1) noise for output position `position`, then moves to the next one."""
        noise = self.noise(vocab, self.position)
        self.position += 1
        return noise

    def noise(self, vocab: int, position: int) -> torch.Tensor:
        """(V,) Exp(1) noise for output `position`, leaving `position` as it is."""
        self._gen.manual_seed(_splitmix64(self._seed_hash ^ position))
        return torch.empty(vocab, device=self.device).exponential_(generator=self._gen)

    def at(self, position: int) -> "_DrawAt":
        """The noise of one output position, for a speculated row (engine/omnibus/engine/spec): drawing it
        moves nothing; the engine sets `position` once it knows how many tokens were kept."""
        return _DrawAt(self, position)


@dataclass(frozen=True)
class _DrawAt:
    draws: SeededDraws
    position: int

    @property
    def device(self) -> torch.device:
        return self.draws.device

    def draw(self, vocab: int) -> torch.Tensor:
        return self.draws.noise(vocab, self.position)


def make_generator(seed: int, device: str | torch.device = "cpu", position: int = 0) -> SeededDraws:
    """The noise source of one seeded request on `device`, starting at output position
    `position` (a continuation's output_offset; 0 for a fresh request).

    The engine keeps it with the request and passes it to every Sampler call; the sampler
    takes exactly one draw (one output position) per sampled token.
    """
    return SeededDraws(seed, device, position)


def allowed_tokens(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    *,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Mask of the tokens each row may sample after top-k, top-p and min-p.

    Args:
        logits: (N, V) float, already divided by temperature.
        top_k: (N,) int64; 0 keeps every token, else the k highest logits.
        top_p: (N,) float in (0, 1]; keep the smallest set of highest-probability tokens
            whose probability mass, renormalized over the top-k survivors, is >= top_p.
        min_p: (N,) float in [0, 1]; drop tokens with prob < min_p * (highest prob).
        max_top_k: max(top_k) if the caller knows it; saves reading it back from the device.
        A filter given as None is off for every row.

    Returns:
        (N, V) bool, True where the token may be sampled. A token tied with the last one
        kept by a cutoff is kept too, so the filters never break ties by token id, and the
        highest logit always survives.
    """
    vocab = logits.shape[1]
    keep = torch.ones_like(logits, dtype=torch.bool)  # (N, V)
    width = 0  # how many of the highest logits top-k has to look at
    if top_k is not None:
        max_top_k = int(top_k.max()) if max_top_k is None else max_top_k
        width = min(max(max_top_k, 1), vocab)
    ranked = None  # (N, V) logits sorted descending, only when a threshold needs them
    if top_p is not None or width > _TOPK_MAX:
        ranked = logits.sort(dim=-1, descending=True).values
    kth: torch.Tensor | None = None  # (N, 1) smallest logit top-k keeps
    if top_k is not None:
        # With no sort around, a partial top-k gives the thresholds far more cheaply.
        best = ranked if ranked is not None else logits.topk(width, dim=-1).values
        kth = best.gather(1, (top_k.clamp(1, best.shape[1]) - 1)[:, None])
        kth = torch.where((top_k > 0)[:, None], kth, -math.inf)
        keep &= logits >= kth
    if top_p is not None:
        assert ranked is not None  # sorted above whenever top_p is given
        if kth is not None:
            # top-p measures mass among what top-k kept (HF / vLLM order).
            ranked = ranked.masked_fill(ranked < kth, -math.inf)
        cum = ranked.softmax(dim=-1).cumsum(dim=-1)  # (N, V), non-decreasing
        # Smallest m with cum[m-1] >= p; float rounding may leave cum[-1] just under 1.
        m = ((cum < top_p[:, None]).sum(dim=-1) + 1).clamp(max=vocab)  # (N,)
        pth = ranked.gather(1, (m - 1)[:, None])  # (N, 1) smallest logit top-p keeps
        pth = torch.where(top_p[:, None] >= 1.0, -math.inf, pth)
        keep &= logits >= pth
    if min_p is not None:
        # prob_i < min_p * prob_max  <=>  logit_i < logit_max + log(min_p): no softmax
        # needed, and renormalizing after top-k / top-p scales both sides alike.
        top = logits.max(dim=-1, keepdim=True).values  # (N, 1)
        keep &= logits >= top + min_p.log()[:, None]  # log(0) = -inf keeps everything
    return keep


def _token_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(n, V) float32 count of each token id in each sequence."""
    lengths = [len(s) for s in seqs]
    longest = max(lengths, default=0)
    # Pad with id V: counts get one spare column that soaks up the padding, then is dropped.
    padded = torch.full((len(seqs), longest), vocab, dtype=torch.long)  # (n, L)
    for row, s in enumerate(seqs):  # one conversion per row, never a loop over tokens
        if lengths[row]:
            padded[row, : lengths[row]] = torch.as_tensor(s, dtype=torch.long)
    real = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]  # (n, L)
    if bool((real & ((padded < 0) | (padded >= vocab))).any()):
        raise ValueError(
            f"token ids for penalties must be in [0, {vocab - 1}] (vocab size {vocab})"
        )
    padded = to_device(padded, torch.long, device)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)  # (n, V + 1)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def apply_logit_bias(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`x` (B, V) plus each row's logit_bias, out of place (`x` itself when no row has one):
    what the sampler, its greedy argmax and the logprobs read. Token ids are < V (the
    engine checks them against the vocabulary when the request arrives)."""
    rows = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return x
    device = x.device
    row_index = to_device([i for i, bias in rows for _ in bias], torch.long, device)
    token_index = to_device([t for _, bias in rows for t, _ in bias], torch.long, device)
    values = to_device([b for _, bias in rows for _, b in bias], torch.float32, device)
    return x.index_put((row_index, token_index), values.to(x.dtype), accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Repetition, then presence / frequency penalties, as float32 (B, V).

    Repetition (HF): every token seen in prompt + output has a positive logit divided by
    the penalty and a negative one multiplied by it. Presence / frequency (OpenAI), over
    output tokens only: logit -= presence * (count > 0) + frequency * count.

    Never writes into `logits`; returns it (cast to float32) untouched when no row has
    penalties, so callers must not write into the result either.
    """
    x = logits.float()  # (B, V); aliases `logits` when it already is float32
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return x
    batch, vocab = x.shape
    device = x.device
    # Only penalized rows pay for the (n, V) count tensors.
    sub_params = [params[i] for i in rows]
    knobs = to_device(
        [(p.repetition_penalty, p.presence_penalty, p.frequency_penalty) for p in sub_params],
        torch.float32, device,
    )  # (n, 3)
    index = to_device(rows, torch.long, device)
    sub = x.index_select(0, index)  # (n, V), a copy we own
    # A continuation's prompt ends with the output an earlier engine produced: it counts
    # as output here, as it did there.
    split = [_split_resumed(prompt_ids[i], output_ids[i], params[i].output_offset) for i in rows]
    out_counts = _token_counts([out for _, out in split], vocab, device)  # (n, V)
    if any(p.repetition_penalty != 1.0 for p in sub_params):
        # Rows without a repetition penalty skip converting their (possibly long) prompts.
        prompts = [prompt if p.repetition_penalty != 1.0 else ()
                   for (prompt, _), p in zip(split, sub_params)]
        seen = (_token_counts(prompts, vocab, device) > 0) | (out_counts > 0)  # (n, V)
        r = knobs[:, 0:1]
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
        # A tiny (or huge) penalty can push a logit past float32's range; an inf would make
        # the row's softmax NaN. Clamped, the row keeps a real distribution.
        sub = sub.clamp_(-_F32_MAX, _F32_MAX)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in sub_params):
        sub = sub - knobs[:, 1:2] * (out_counts > 0) - knobs[:, 2:3] * out_counts
    if len(rows) == batch:
        return sub
    return x.index_copy(0, index, sub)  # out of place: x may be the caller's tensor


def _split_resumed(
    prompt: Sequence[int], output: Sequence[int], offset: int
) -> tuple[Sequence[int], Sequence[int]]:
    """(prompt, output) with a continuation's last `offset` prompt tokens moved to the
    front of the output."""
    if not offset:
        return prompt, output
    if offset > len(prompt):
        raise ValueError(f"output_offset {offset} exceeds the prompt's {len(prompt)} tokens")
    cut = len(prompt) - offset
    return prompt[:cut], [*prompt[cut:], *output]


def _same_device(a: torch.device, b: torch.device) -> bool:
    # torch.device("cuda") has no index; treat it as matching any cuda device.
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _check_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    generators: Sequence[SeededDraws | None],
) -> None:
    if logits.dim() != 2 or not logits.is_floating_point() or logits.shape[1] == 0:
        raise ValueError(
            "logits must be a (batch, vocab) float tensor, "
            f"got shape {tuple(logits.shape)} dtype {logits.dtype}"
        )
    batch = logits.shape[0]
    lengths = {
        "params": len(params),
        "prompt_ids": len(prompt_ids),
        "output_ids": len(output_ids),
        "generators": len(generators),
    }
    if any(n != batch for n in lengths.values()):
        raise ValueError(f"need one entry per logits row ({batch}), got {lengths}")
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.seed is not None and g is None and not p.greedy:
            raise ValueError(
                f"row {i} has seed={p.seed} but no generator; pass make_generator(seed, device)"
            )
        if g is not None and not _same_device(g.device, logits.device):
            raise ValueError(
                f"row {i}: generator is on {g.device} but logits are on {logits.device}"
            )


class Sampler:
    """Picks one token per row of a logits batch; see the module docstring for the order.

    Stateless across calls except for the shared generator that unseeded rows draw from.
    """

    def __init__(self, seed: int | None = None) -> None:
        """`seed` fixes the shared generator for unseeded rows; None seeds it from the OS."""
        if seed is not None:
            seed = check_seed(seed)
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}  # one per device, made lazily

    def __call__(self, *args, **kwargs) -> SamplerOutput:
        """`sample` (same arguments), with the picks read back to the host."""
        return self.sample(*args, **kwargs).output()

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[SeededDraws | None],
    ) -> SampledBatch:
        """Sample one token per row, leaving the result on the logits' device (no sync).

        Args:
            logits: (B, V) any float dtype; not modified.
            params: row i is sampled with params[i].
            prompt_ids, output_ids: request i's tokens so far, for penalties.
            generators: request i's own SeededDraws (from make_generator) when it has a
                seed, else None. Advanced by one output position when row i is sampled.

        Raises:
            ValueError: mismatched batch sizes, a seeded row without a generator, a
                generator on another device, or penalty token ids outside [0, V).
        """
        _check_batch(logits, params, prompt_ids, output_ids, generators)
        batch = logits.shape[0]
        if all(p.greedy and not p.has_penalties and not p.logit_bias and p.logprobs == 0 for p in params):
            return SampledBatch(logits.argmax(dim=-1))  # the common serving case

        x = apply_penalties(logits, params, prompt_ids, output_ids)  # (B, V) float32, read-only
        x = apply_logit_bias(x, params)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled) == batch:
            tokens = self._sample(x, params, generators)
        else:
            tokens = x.argmax(dim=-1)  # (B,)
            if sampled:
                index = to_device(sampled, torch.long, x.device)
                picked = self._sample(
                    x.index_select(0, index),
                    [params[i] for i in sampled],
                    [generators[i] for i in sampled],
                )
                tokens.index_copy_(0, index, picked)  # tokens is ours
        return _with_logprobs(x, tokens, params)

    def _sample(
        self,
        x: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[SeededDraws | None],
    ) -> torch.Tensor:
        """(N,) token ids drawn from (N, V) penalized logits of non-greedy rows."""
        n, vocab = x.shape
        device = x.device
        # All per-row knobs in one host-to-device copy. top_k <= V keeps it exact in float32.
        knobs = to_device(
            [(p.temperature, min(p.top_k, vocab), p.top_p, p.min_p) for p in params],
            torch.float32, device,
        )  # (N, 4)
        x = (x / knobs[:, 0:1]).clamp_(-_F32_MAX, _F32_MAX)  # (N, V), new; no inf (as above)
        use_k = any(p.top_k > 0 for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        if use_k or use_p or use_min_p:
            keep = allowed_tokens(
                x,
                top_k=knobs[:, 1].long() if use_k else None,
                top_p=knobs[:, 2] if use_p else None,
                min_p=knobs[:, 3] if use_min_p else None,
                max_top_k=max(min(p.top_k, vocab) for p in params),
            )
            x = x.masked_fill_(~keep, -math.inf)  # x is our own tensor here
        probs = x.softmax(dim=-1)  # (N, V)
        noise = self._noise(generators, vocab, device)  # (N, V) ~ Exp(1)
        return (probs / noise).argmax(dim=-1)

    def _noise(
        self, generators: Sequence[SeededDraws | None], vocab: int, device: torch.device
    ) -> torch.Tensor:
        """(N, V) Exp(1) noise: each seeded row from its own generator, the rest shared."""
        shared_rows = [j for j, g in enumerate(generators) if g is None]
        shared = None
        if shared_rows:
            shared = torch.empty(len(shared_rows), vocab, device=device)
            shared.exponential_(generator=self._shared_generator(device))
            if len(shared_rows) == len(generators):
                return shared.clamp_min_(torch.finfo(torch.float32).tiny)
        rows: list[torch.Tensor] = []
        shared_iter = iter(shared.unbind(0) if shared is not None else ())
        for g in generators:
            if g is None:
                rows.append(next(shared_iter))
            else:
                # A fresh (V,) tensor per request: its values depend only on its seed and
                # output position, never on the row's place in the batch.
                rows.append(g.draw(vocab))
        # exponential_ can return exactly 0; probs / 0 would be inf (or NaN for prob 0).
        return torch.stack(rows).clamp_min_(torch.finfo(torch.float32).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._shared[device] = gen
        return gen


def _with_logprobs(x: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]) -> SampledBatch:
    """The picks plus, for rows that asked, the chosen token's logprob and the top-n,
    from penalized logits x (B, V)."""
    rows = [i for i, p in enumerate(params) if p.logprobs > 0]
    if not rows:
        return SampledBatch(tokens)
    index = to_device(rows, torch.long, x.device)
    lp = x.index_select(0, index).log_softmax(dim=-1)  # (n, V)
    chosen = lp.gather(1, tokens.index_select(0, index)[:, None])[:, 0]  # (n,)
    width = min(max(params[i].logprobs for i in rows), x.shape[1])
    top = lp.topk(width, dim=-1)  # (n, width) each, highest first
    return SampledBatch(tokens, rows, [params[i].logprobs for i in rows], chosen, top.indices, top.values)
