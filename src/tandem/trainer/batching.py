"""Rows: samples packed padding-free into one sequence, in the layout tree packing generalises.

Every token carries `end[j]`, the last packed index of its segment; query q may attend key k iff
k <= q <= end[k] (DESIGN.md §4). With one segment per sample that is exactly "causal within the
sample", and the same rule covers shared-prefix tries. Each trained token is predicted at the index
of the token before it.
"""

from dataclasses import dataclass

import torch

from tandem.rollout.records import Sample


@dataclass
class Row:
    input_ids: torch.Tensor        # [T]
    position_ids: torch.Tensor     # [T]
    end: torch.Tensor              # [T] last index of each token's segment
    predict_index: torch.Tensor    # [N] index whose logits predict trained token n
    targets: torch.Tensor          # [N]
    old_logprobs: torch.Tensor     # [N] sampler log-probs
    advantages: torch.Tensor       # [N]
    term_sample: torch.Tensor      # [N] which sample of the row each trained token belongs to
    samples: list[Sample]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_trained(self) -> int:
        return int(self.targets.numel())


def pack_row(samples: list[Sample]) -> Row:
    ids, positions, ends, predict, targets, old, adv, owner = [], [], [], [], [], [], [], []
    for s_index, sample in enumerate(samples):
        start = len(ids)
        n = sample.num_tokens
        ids += sample.input_ids
        positions += range(n)
        ends += [start + n - 1] * n
        for j in range(1, n):
            if sample.trained[j]:
                predict.append(start + j - 1)
                targets.append(sample.input_ids[j])
                old.append(sample.logprobs[j])
                adv.append(sample.advantage)
                owner.append(s_index)
    return Row(
        input_ids=torch.tensor(ids), position_ids=torch.tensor(positions), end=torch.tensor(ends),
        predict_index=torch.tensor(predict, dtype=torch.long), targets=torch.tensor(targets, dtype=torch.long),
        old_logprobs=torch.tensor(old, dtype=torch.float32), advantages=torch.tensor(adv, dtype=torch.float32),
        term_sample=torch.tensor(owner, dtype=torch.long), samples=list(samples),
    )


def attention_mask(end: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] boolean: query q sees key k iff k <= q <= end[k]."""
    index = torch.arange(end.numel(), device=end.device)
    q, k = index[:, None], index[None, :]
    return ((k <= q) & (q <= end[None, :]))[None, None]
