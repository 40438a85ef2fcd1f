"""What the engine is asked and what it answers: an `EngineRequest` (a prompt, its sampling parameters and `n`
sequences to sample), each `Sequence` it grows token by token, and `EngineStats`, the figures `/metrics` shows."""

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.serve.sampling import SamplingParams


@dataclass
class Sequence:
    """One generated continuation: tokens, their log-probs, and why it ended."""

    index: int
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float, int]]] = field(default_factory=list)
    sampling_masks: list[list[int]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    checked: int = 0
    """Tokens whose stop conditions the engine has checked without finishing: what a stream may show while the
    sequence runs (its lists may already hold a newer token, and its last one arrives with `finish_reason`)."""
    weight_versions: list[tuple[str, int]] = field(default_factory=list)
    """(version, first token) of each run of `output` sampled under one weights' label: a swap between two steps
    starts a new run, which ends where the next begins (the last at the output's end)."""


@dataclass
class EngineRequest:
    """A prompt and `n` sequences to sample from it. `notify` is called (on the engine thread) after each step."""

    prompt: list[int]
    params: SamplingParams
    n: int = 1
    adapter: str | None = None
    return_sampling_mask: bool = False
    stop_check: Callable[[list[int]], str | None] | None = None
    notify: Callable[[], None] = lambda: None
    sequences: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None
    aborted: bool = False
    cache_salt: str | None = None
    """Requests with different salts share no prefix-cache block (vLLM's isolation of tenants)."""
    reads_prefix_cache: bool = True
    """False: prefilled whole (`skip_reading_prefix_cache`; prompt log-probs need every position's logits)."""
    cached_tokens: int = 0
    """Prompt tokens whose KV the prefix cache held when the request was prefilled."""
    created_cache_tokens: int = 0
    """Prompt tokens whose KV this request's prefill added to the prefix cache."""
    prefix_epoch: int = -1
    """The prefix cache's epoch when this request's KV was computed: KV of replaced weights is never stored."""
    error: str | None = None
    """Why the request failed on its own (the engine keeps serving the others)."""
    error_status: int = 500
    """400 when the request itself asked for the impossible (its masks left no token to sample)."""

    def __post_init__(self):
        if not self.sequences:
            self.sequences = [Sequence(i, seeded_generator(self.params.seed, i)) for i in range(self.n)]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    @property
    def cache_namespace(self) -> str:
        """What seeds the prefix-cache hashes of this request's blocks: its adapter and salt."""
        return repr((self.adapter, self.cache_salt))


def seeded_generator(seed: int | None, child: int) -> torch.Generator:
    """Child i of a seeded request uses seed + i (as vLLM does); unseeded ones draw from the OS."""
    generator = torch.Generator()
    generator.manual_seed((seed + child) if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return generator


@dataclass
class EngineStats:
    """Load and cumulative counters. Prompt tokens actually prefilled = prompt_tokens_total - prefix_cache_hits_total."""

    running: int
    waiting: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    preemptions_total: int
    finished_total: dict[str, int]
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prefix_cache_tokens: int
    """Tokens whose KV the prefix cache holds now."""
