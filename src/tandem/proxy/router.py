"""Prefix-aware routing: send a request to the replica that already holds its prompt's KV prefix.

A prompt is cut into whole blocks (16 tokens, as vLLM's prefix cache counts them) and each block is named
by a chained hash seeded with the model (adapter) name, so a hash names the whole prefix up to it and a new
adapter version starts a new namespace. The router remembers which replicas were sent each block and which
blocks followed it. Blocks every replica holds, or that fan out to two or more successors, identify no
prompt (a chat template, a system prompt): only the blocks after them count as affinity. Then:

  affinity   a replica holds blocks specific to the prompt and is at most `imbalance` requests busier
             than the least-loaded replica: it gets the request;
  spilled    such a replica exists but is too busy: the least-loaded replica gets it;
  unmatched  no replica holds a specific block: the least-loaded replica, round-robin on ties.

Once a prompt has spilled to every replica its blocks count as common and load alone places
its later rollouts, counted unmatched, though the chosen replica's cache still hits.
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

KINDS = ("affinity", "spilled", "unmatched")


@dataclass
class Block:
    owners: set[int] = field(default_factory=set)
    successors: set[bytes] = field(default_factory=set)
    """Distinct next blocks seen, at most two: enough to tell one continuation from several."""


@dataclass
class Decision:
    replica: int
    kind: str
    specific_blocks: int


def _hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class PrefixRouter:
    def __init__(self, num_replicas: int, block_size: int = 16, imbalance: int = 8, max_blocks: int = 500_000):
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas}: the router needs at least one replica")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.imbalance = imbalance
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.counts = dict.fromkeys(("routed", *KINDS), 0)
        self.round_robin = 0

    def block_hashes(self, model: str, prompt: list[int] | bytes) -> list[bytes]:
        """Chained hashes of the prompt's whole blocks: token ids in blocks of `block_size`, or text (bytes) in
        blocks of 4 x block_size bytes (about 4 bytes a token) when there is no tokenizer."""
        size = self.block_size if not isinstance(prompt, bytes) else 4 * self.block_size
        hashes, previous = [], _hash(model.encode())
        for start in range(0, len(prompt) - size + 1, size):
            chunk = prompt[start : start + size]
            data = chunk if isinstance(chunk, bytes) else ",".join(map(str, chunk)).encode()
            previous = _hash(previous + data)
            hashes.append(previous)
        return hashes

    def matched_prefix(self, hashes: list[bytes]) -> list[int]:
        """Per replica, how many leading blocks it holds, without a gap."""
        matched, alive = [0] * self.num_replicas, set(range(self.num_replicas))
        for h in hashes:
            block = self.blocks.get(h)
            alive &= block.owners if block else set()
            if not alive:
                break
            for replica in alive:
                matched[replica] += 1
        return matched

    def common_prefix_len(self, hashes: list[bytes]) -> int:
        """Leading blocks that identify no prompt: up to the last one every replica holds or that fans out."""
        common = 0
        for index, h in enumerate(hashes):
            block = self.blocks.get(h)
            if block is None:
                break
            if len(block.owners) == self.num_replicas or len(block.successors) >= 2:
                common = index + 1
        return common

    def choose(self, model: str, prompt: list[int] | bytes, inflight: list[float]) -> Decision:
        """Pick the replica for one request (given each replica's generation requests in flight) and record it."""
        hashes = self.block_hashes(model, prompt)
        common = self.common_prefix_len(hashes)
        matched = self.matched_prefix(hashes)
        specific = [max(0, m - common) for m in matched]
        least = min(inflight)
        best = max(range(self.num_replicas), key=lambda i: (specific[i], -inflight[i], -i))
        if specific[best] > 0 and inflight[best] - least <= self.imbalance:
            decision = Decision(best, "affinity", specific[best])
        else:
            candidates = [i for i in range(self.num_replicas) if inflight[i] == least]
            pick = candidates[self.round_robin % len(candidates)]
            self.round_robin += 1
            decision = Decision(pick, "spilled" if specific[best] else "unmatched", 0)
        self.record(hashes, decision.replica)
        self.counts["routed"] += 1
        self.counts[decision.kind] += 1
        return decision

    def record(self, hashes: list[bytes], replica: int) -> None:
        """`replica` was sent these blocks: it owns them, and each is followed by the next."""
        for h, following in zip(hashes, hashes[1:] + [None]):
            block = self.blocks.get(h)
            if block is None:
                block = self.blocks[h] = Block()
            block.owners.add(replica)
            if following is not None and len(block.successors) < 2:
                block.successors.add(following)
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def forget(self, replica: int) -> None:
        """The replica lost its cache (prefix-cache reset, restart, repeated failure): it owns nothing now."""
        for h in list(self.blocks):
            block = self.blocks[h]
            block.owners.discard(replica)
            if not block.owners:
                del self.blocks[h]

    def stats(self) -> dict:
        return {**self.counts, "tracked_blocks": len(self.blocks)}
