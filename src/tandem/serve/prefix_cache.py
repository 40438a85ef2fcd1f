"""Automatic prefix caching: the KV of whole 16-token blocks kept across requests, so a prompt that repeats an
earlier one (the next turn of a conversation) prefills only its new tokens.

As in vLLM, a block is named by a chained hash of its tokens and the previous block's hash, seeded with the
request's namespace (the adapter serving it and its `cache_salt`): a hash names the whole prefix up to its block,
and requests of different adapters or salts never share KV. Only whole blocks are kept and matched, and a lookup always leaves the prompt's last token to be
computed (its logits pick the first output token). Blocks are kept least-recently-used within a token bound;
a hit refreshes the blocks from the last to the first, so a chain loses its tail before its head. The
engine clears the cache whenever the weights change; `epoch` counts the clears, so KV computed before one
is never stored after it.
"""

import collections
import hashlib
from array import array
from collections.abc import Callable

import torch

from tandem.serve.kv_cache import SlotKVCache
from tandem.serve.requests import EngineRequest

BLOCK_SIZE = 16


def block_hashes(tokens: list[int], namespace: str, block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The chained hash of every whole block of `tokens`, the first seeded with the namespace."""
    hashes, previous = [], hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = array("q", tokens[start : start + block_size]).tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        hashes.append(previous)
    return hashes


class PrefixCache:
    """Block hash -> that block's keys and values, `[2, layers, kv_heads, block_size, head_dim]`, in LRU order."""

    def __init__(self, max_tokens: int, block_size: int = BLOCK_SIZE):
        if max_tokens < 0:
            raise ValueError(f"prefix cache bound of {max_tokens} tokens: it must be 0 or more")
        self.block_size = block_size
        self.max_blocks = max_tokens // block_size
        self.blocks: collections.OrderedDict[bytes, torch.Tensor] = collections.OrderedDict()
        self.epoch = 0
        self.queries = 0
        """Prompt tokens looked up (vLLM's `prefix_cache_queries`)."""
        self.hits = 0
        """Prompt tokens found cached (vLLM's `prefix_cache_hits`)."""

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    def lookup(self, prompt: list[int], namespace: str) -> tuple[int, torch.Tensor | None]:
        """The longest cached run of whole blocks at the start of `prompt`, short of its last token: its length
        and its KV, `[2, layers, kv_heads, length, head_dim]` (None when nothing matched)."""
        hashes = block_hashes(prompt[:-1], namespace, self.block_size)
        matched = hashes[: self._cached_run(hashes)]
        self._touch(matched)
        length = len(matched) * self.block_size
        self.queries += len(prompt)
        self.hits += length
        return length, torch.cat([self.blocks[h] for h in matched], dim=3) if matched else None

    def uncached_blocks(self, prompt: list[int], namespace: str) -> list[bytes]:
        """The hashes of the blocks a lookup of `prompt` would not find: those after its cached run."""
        hashes = block_hashes(prompt[:-1], namespace, self.block_size)
        return hashes[self._cached_run(hashes) :]

    def _cached_run(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, are cached."""
        return next((i for i, h in enumerate(hashes) if h not in self.blocks), len(hashes))

    def split_shared(self, requests: list) -> tuple[list, list]:
        """Requests (each with `prompt` and `cache_namespace`) whose first uncached block an earlier one computes in
        this step (a group's rollouts sent one by one, a shared system prompt) are put after it, to be prefilled in a
        second forward that finds that prefix cached."""
        leaders, followers, computed = [], [], set()
        for request in requests:
            uncached = self.uncached_blocks(request.prompt, request.cache_namespace)
            if uncached and uncached[0] in computed:
                followers.append(request)
            else:
                leaders.append(request)
                computed.update(uncached)
        return leaders, followers

    def store(self, tokens: list[int], namespace: str, kv: Callable[[int, int], torch.Tensor]) -> int:
        """Keep the whole blocks of `tokens`, whose KV is in a cache row: `kv(start, stop)` returns positions
        start..stop-1 as `lookup` returns them. Only the blocks not yet cached are read; returns the tokens they
        hold."""
        hashes = block_hashes(tokens, namespace, self.block_size)
        missing = [i for i, h in enumerate(hashes) if h not in self.blocks]
        if missing:
            first = missing[0] * self.block_size
            new = kv(first, len(hashes) * self.block_size).split(self.block_size, dim=3)
            for i in missing:
                self.blocks[hashes[i]] = new[i - missing[0]].clone()
        self._touch(hashes)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)
        return len(missing) * self.block_size

    def clear(self) -> None:
        """Drop every block (the weights changed); KV computed before now must not be stored."""
        self.blocks.clear()
        self.epoch += 1

    def _touch(self, hashes: list[bytes]) -> None:
        """Mark blocks used, the first last: eviction then takes a chain's tail before the blocks it hangs on."""
        for h in reversed(hashes):
            self.blocks.move_to_end(h)

    def load_prompt(self, request: EngineRequest, cache: SlotKVCache, row: int) -> int:
        """Copy the request prompt's cached leading blocks into `row` of `cache`; returns how many tokens they cover.
        A request asking for prompt log-probs needs every prompt position's logits, so it reads nothing (as in vLLM)."""
        request.prefix_epoch = self.epoch
        if not request.reads_prefix_cache or request.params.prompt_logprobs is not None:
            return 0
        length, kv = self.lookup(request.prompt, request.cache_namespace)
        if kv is not None:
            cache.write(row, kv)
        request.cached_tokens = length
        return length

    def store_row(self, request: EngineRequest, tokens: list[int], cache: SlotKVCache, row: int) -> int:
        """Keep the whole blocks of `tokens`, whose KV fills the start of `row`, unless the weights changed since the
        request was prefilled; returns the tokens newly cached."""
        if request.prefix_epoch != self.epoch:
            return 0
        return self.store(tokens, request.cache_namespace, lambda start, stop: cache.read(row, start, stop))
