"""The proposer interface and the scheduler's side of speculation (torch-free)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Protocol

from omnibus.engine.core.sequence import Sequence

PROPOSERS = ("ngram", "draft")
MAX_GUESSES = 16  # --num-speculative-tokens at most


class Proposer(Protocol):
    name: str

    def propose(self, seqs: list[Sequence], k: list[int]) -> list[list[int]]:
        """Up to k[i] guessed next tokens for each of `seqs` (whose last token is known),
        in order; fewer (or none) when it has no good guess."""
        ...

    def release(self, seq: Sequence) -> None:
        """`seq` left the running set (finished, aborted, preempted): drop its state."""
        ...

    def check_integrity(self) -> None:
        """Prove the bookkeeping of what it keeps (RuntimeError if wrong)."""
        ...


@dataclass(frozen=True)
class SpecConfig:
    """How an engine speculates. `method` None: never."""

    method: str | None = None  # "ngram" | "draft"
    num_tokens: int = 4  # guesses per sequence per step at most
    # Speculation pays at small batches, where a step reads the weights for a few tokens;
    # above this many running sequences the step is compute-bound and it turns itself off.
    max_batch: int = 8
    ngram_max: int = 4  # the n-gram proposer matches the last ngram_max..ngram_min tokens
    ngram_min: int = 2
    draft_model: str | None = None  # the draft proposer's checkpoint directory (the target's tokenizer)

    def __post_init__(self) -> None:
        # the messages name the flags (EngineConfig adds the dashes)
        if self.method is not None and self.method not in PROPOSERS:
            raise ValueError(f"speculative must be one of {', '.join(PROPOSERS)}, got {self.method!r}")
        if not 1 <= self.num_tokens <= MAX_GUESSES:
            raise ValueError(f"num-speculative-tokens must be in [1, {MAX_GUESSES}], got {self.num_tokens}")
        if self.max_batch < 1:
            raise ValueError(f"speculative-max-batch must be >= 1, got {self.max_batch}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("speculative-draft-model is needed by, and only by, --speculative draft")


@dataclass
class SpecStats:
    """Counters since start, per proposer: guesses made, guesses the target kept, and
    tokens emitted by speculating sequences (kept guesses + the target's own token)."""

    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    steps: int = 0  # sequence-steps that speculated
    # accepted guesses per speculating sequence-step: index = how many were kept
    accepted_hist: list[int] = field(default_factory=lambda: [0] * (MAX_GUESSES + 1))

    proposer: str = "ngram"

    def snapshot(self) -> "SpecStats":
        return SpecStats(self.proposed, self.accepted, self.emitted, self.steps, list(self.accepted_hist),
                         self.proposer)

    def accepted_per_position(self) -> list[int]:
        """Guesses kept at each guess position (vLLM's num_accepted_tokens_per_pos)."""
        out, kept = [], 0
        for n in range(len(self.accepted_hist) - 1, 0, -1):
            kept += self.accepted_hist[n]
            out.append(kept)
        return out[::-1]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per speculating sequence-step (1 = no guess kept)."""
        return self.emitted / self.steps if self.steps else 0.0


class NgramProposer:
    """Prompt lookup: the latest earlier place where the sequence's last n tokens occur
    (n from ngram_max down to ngram_min, in its prompt and output so far) predicts the
    tokens that followed it there. Host-side, no model; the search runs at C speed
    (bytes.rfind over the tokens as int32)."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], k: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, n) for seq, n in zip(seqs, k)]

    def release(self, seq: Sequence) -> None:
        pass  # nothing kept per sequence

    def check_integrity(self) -> None:
        pass  # nothing kept

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier match of the last n tokens,
        preferring the latest match that k tokens follow (a loop's earlier turn, say)."""
        size = len(tokens)
        if k <= 0 or size < self.min_n + 1:
            return []
        data = array("i", tokens).tobytes()
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            pattern = data[-4 * n:]
            # a match must end before the last token (something follows it); first look
            # where k tokens follow it
            for end in (size - k, size - 1):
                start = _rfind_aligned(data, pattern, 4 * end)
                if start is not None:
                    return tokens[start + n:start + n + k]
        return []


def _rfind_aligned(data: bytes, pattern: bytes, end: int) -> int | None:
    """The token index of the latest token-aligned occurrence of `pattern` ending by byte
    `end`, or None."""
    while end >= len(pattern):
        at = data.rfind(pattern, 0, end)
        if at < 0:
            return None
        if at % 4 == 0:
            return at // 4
        end = at + len(pattern) - 1
    return None


class Speculator:
    """The scheduler's side: which sequences speculate this step, with which guesses, and
    the counters."""

    def __init__(self, config: SpecConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = SpecStats(proposer=proposer.name)

    def active(self, num_running: int) -> bool:
        return num_running <= self.config.max_batch

    def guesses(self, seqs: list[Sequence], room: list[int]) -> list[list[int]]:
        """Guesses for `seqs`, at most room[i] (and num_tokens) each."""
        k = [min(self.config.num_tokens, r) for r in room]
        return self.proposer.propose(seqs, k)

    def verified(self, guess: list[int], sampled: list[int]) -> int:
        """How many leading guesses the target's own picks confirm (sampled[j] is the
        target's pick at the position of guess[j]); counts them (the scheduler counts
        the tokens emitted, once stop tokens and lengths have cut them)."""
        kept = 0
        while kept < len(guess) and guess[kept] == sampled[kept]:
            kept += 1
        s = self.stats
        s.proposed += len(guess)
        s.accepted += kept
        s.steps += 1
        s.accepted_hist[kept] += 1
        return kept
