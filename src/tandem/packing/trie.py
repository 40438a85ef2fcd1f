"""Tree packing: the samples of a row folded into a prefix trie and laid out depth-first.

A trie node is keyed by (token, next token), so two samples share a node only when they also agree on
what follows it: the trie branches one token before the samples diverge, and every node predicts a
single next token. Walking the trie depth-first and collapsing unary chains gives segments; a token's
`position_id` is its depth, and `end[j]` is the last packed index of its segment's subtree, so query q
may attend key k iff k <= q <= end[k]. Samples that share nothing are plain
padding-free packing. Every trained token keeps its own loss term, read at the packed index of the
token before it; a shared position can serve several samples.

A model a tree row would change (layers that scan across tokens, attention the tree kernels lack) gets `padded`
rows instead: no token shared, sample s laid out at indices s * width .. s * width + width - 1, right-padded to the
longest sample (`width`), so the row reshapes to a [samples, width] batch of plain causal sequences. The same loss
terms are gathered the same way, and its `end` (each sample's block) still states which tokens see which.
"""

from dataclasses import dataclass, field

import torch

from tandem.contract.records import Sample
from tandem.errors import UsageError

TREE, PADDED = "tree", "padded"
LAYOUTS = (TREE, PADDED)


@dataclass
class Node:
    token: int
    depth: int
    children: dict = field(default_factory=dict)
    index: int = -1
    """Packed index, set by `TrieRow.pack`."""


@dataclass
class Insertion:
    """What adding one sample to a row would cost: new unique tokens, new loss terms, new attention load."""

    new_tokens: int
    new_terms: int
    new_load: int


@dataclass
class PackedRow:
    """One row ready to forward: the packed tokens and one entry per loss term."""

    input_ids: torch.Tensor  # [T]
    position_ids: torch.Tensor  # [T] depth in the trie
    end: torch.Tensor  # [T] last packed index of each token's segment subtree
    predict_index: torch.Tensor  # [N] packed index whose output predicts term n
    targets: torch.Tensor  # [N]
    behavior_log_probs: torch.Tensor  # [N] the sampler's log-probs of the targets
    advantages: torch.Tensor  # [N]
    term_sample: torch.Tensor  # [N] which sample of the row term n belongs to
    sampling_mask: torch.Tensor | None  # [N, K] the sampler's kept token ids per term (-1 pads), when it truncated
    sampler_ids: torch.Tensor | None  # [N, K] the sampler's most likely tokens at each term's position (0 pads)
    sampler_logprobs: torch.Tensor | None  # [N, K] their sampler log-probs (-inf pads)
    samples: list[Sample]
    raw_tokens: int
    """Tokens before packing (each sample's full length)."""
    load: int
    """Attention-cost proxy: the sum over packed tokens of (depth + 1)."""
    layout: str = TREE
    """TREE: one sequence under the tree mask; PADDED: len(samples) right-padded sequences of equal width."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_trained(self) -> int:
        return int(self.targets.numel())

    @property
    def packing_ratio(self) -> float:
        return self.raw_tokens / max(self.num_tokens, 1)


def _keys(ids: list[int]):
    return zip(ids, ids[1:] + [None])


class TrieRow:
    """A row being filled: samples are inserted one by one, shared prefixes stored once (in the tree layout)."""

    def __init__(self, share_prefixes: bool = True, layout: str = TREE):
        if layout not in LAYOUTS:
            raise ValueError(f"row layout {layout!r} is not one of {LAYOUTS}")
        self.root = Node(token=-1, depth=-1)
        self.layout = layout
        self.share_prefixes = share_prefixes and layout == TREE
        self.samples: list[Sample] = []
        self.paths: list[list[Node]] = []
        """Each sample's nodes, one per token."""
        self.groups: set[int] = set()
        self.num_tokens = 0
        self.num_terms = 0
        self.load = 0

    def cost(self, sample: Sample) -> Insertion:
        """The cost of inserting `sample`, without inserting it."""
        if self.layout == PADDED:
            return self._padded_cost(sample)
        node, shared = self.root, 0
        if self.share_prefixes:
            for key in _keys(sample.input_ids):
                child = node.children.get(key)
                if child is None:
                    break
                node, shared = child, shared + 1
        n = sample.num_tokens
        new_load = sum(range(shared + 1, n + 1))  # a new node at depth j costs j + 1
        return Insertion(new_tokens=n - shared, new_terms=sum(sample.trained[1:]), new_load=new_load)

    def _padded_cost(self, sample: Sample) -> Insertion:
        """A padded row forwards every sample at the longest one's width: what `sample` adds, padding included."""
        width = max(
            sample.num_tokens, self.num_tokens // len(self.samples) if self.samples else 0
        )  # tokens = samples x width
        count = len(self.samples) + 1
        return Insertion(
            new_tokens=count * width - self.num_tokens,
            new_terms=sum(sample.trained[1:]),
            new_load=count * width * (width + 1) // 2 - self.load,
        )

    def add(self, sample: Sample) -> None:
        cost = self.cost(sample)
        node, path = self.root, []
        for depth, key in enumerate(_keys(sample.input_ids)):
            child = node.children.get(key) if self.share_prefixes else None
            if child is None:
                child = Node(token=key[0], depth=depth)
                # Without sharing every sample gets its own chain: a fresh key keeps chains apart.
                node.children[key if self.share_prefixes else len(node.children)] = child
            node = child
            path.append(node)
        self.samples.append(sample)
        self.paths.append(path)
        self.groups.add(sample.group_id)
        self.num_tokens += cost.new_tokens
        self.num_terms += cost.new_terms
        self.load += cost.new_load

    def pack(self) -> PackedRow:
        """Lay the row out (the trie depth-first, or the samples padded side by side) and gather every sample's loss terms."""
        ids, positions, ends = self._lay_out_padded() if self.layout == PADDED else self._lay_out_tree()
        predict, targets, behavior, adv, owner, kept, top = [], [], [], [], [], [], []
        for s, (sample, path) in enumerate(zip(self.samples, self.paths)):
            for j in range(1, sample.num_tokens):
                if sample.trained[j]:
                    predict.append(path[j - 1].index)
                    targets.append(sample.input_ids[j])
                    behavior.append(sample.behavior_log_probs[j])
                    adv.append(sample.advantage)
                    owner.append(s)
                    kept.append(sample.sampling_mask[j] if sample.sampling_mask else None)
                    top.append(sample.sampler_logprobs[j] if sample.sampler_logprobs else None)
        return PackedRow(
            input_ids=torch.tensor(ids, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
            end=torch.tensor(ends, dtype=torch.long),
            predict_index=torch.tensor(predict, dtype=torch.long),
            targets=torch.tensor(targets, dtype=torch.long),
            behavior_log_probs=torch.tensor(behavior, dtype=torch.float32),
            advantages=torch.tensor(adv, dtype=torch.float32),
            term_sample=torch.tensor(owner, dtype=torch.long),
            sampling_mask=_pad_kept(kept),
            **_pad_top(top),
            samples=list(self.samples),
            raw_tokens=sum(s.num_tokens for s in self.samples),
            load=self.load,
            layout=self.layout,
        )

    def _lay_out_padded(self) -> tuple[list[int], list[int], list[int]]:
        """Sample s at indices s * width + j, pads (token 0) after it; each sample's block sees only itself."""
        width = max(s.num_tokens for s in self.samples)
        ids: list[int] = []
        positions: list[int] = []
        ends: list[int] = []
        for s, (sample, path) in enumerate(zip(self.samples, self.paths)):
            for j, node in enumerate(path):
                node.index = s * width + j
            ids += sample.input_ids + [0] * (width - sample.num_tokens)
            positions += range(width)
            ends += [(s + 1) * width - 1] * width
        return ids, positions, ends

    def _lay_out_tree(self) -> tuple[list[int], list[int], list[int]]:
        """The trie depth-first (pre-order), segment by segment: each node's packed index, token, depth and subtree end."""
        ids: list[int] = []
        positions: list[int] = []
        ends: list[int] = []
        stack: list = list(reversed(self.root.children.values()))  # nodes, and (start, stop, _CLOSE) after a segment
        while stack:
            node = stack.pop()
            if node is _CLOSE:  # the segment below and its whole subtree are laid out
                stop, start = stack.pop(), stack.pop()
                ends[start:stop] = [len(ids) - 1] * (stop - start)
                continue
            start = len(ids)
            while True:  # one segment: follow the chain while it does not branch
                node.index = len(ids)
                ids.append(node.token)
                positions.append(node.depth)
                ends.append(-1)
                if len(node.children) != 1:
                    break
                node = next(iter(node.children.values()))
            stack += [start, len(ids), _CLOSE]
            stack += reversed(node.children.values())
        return ids, positions, ends


def _pad_kept(kept: list[list[int] | None]) -> torch.Tensor | None:
    """Per-term kept sets as one [N, K] tensor padded with -1; None when no term has one."""
    given = [k for k in kept if k is not None]
    if not given:
        return None
    if len(given) < len(kept):
        raise UsageError(
            f"{len(kept) - len(given)} of {len(kept)} trained tokens have no sampling mask while the others do: "
            "renormalising only some of them would bias the ratio. Every sampled token needs its kept set."
        )
    width = max(len(k) for k in given)
    return torch.tensor([k + [-1] * (width - len(k)) for k in given], dtype=torch.long)


def _pad_top(top: list[dict[int, float] | None]) -> dict:
    """Per-term sampler top-K as [N, K] ids (0 pads) and log-probs (-inf pads); None when no term has them."""
    given = [t for t in top if t is not None]
    if not given:
        return {"sampler_ids": None, "sampler_logprobs": None}
    if len(given) < len(top):
        raise UsageError(
            "some trained tokens have the sampler's top log-probs and others do not: score centering needs "
            "them at every sampled position (request logprobs=num_sampler_logprobs in every turn)"
        )
    width = max(len(t) for t in given)
    ids = [list(t) + [0] * (width - len(t)) for t in given]
    logprobs = [list(t.values()) + [float("-inf")] * (width - len(t)) for t in given]
    return {
        "sampler_ids": torch.tensor(ids, dtype=torch.long),
        "sampler_logprobs": torch.tensor(logprobs, dtype=torch.float32),
    }


_CLOSE = object()
"""Stack marker: every node of the segment below it has been laid out; its subtree ends here."""


def pack(samples: list[Sample], share_prefixes: bool = True, layout: str = TREE) -> PackedRow:
    row = TrieRow(share_prefixes, layout)
    for sample in samples:
        row.add(sample)
    return row.pack()
