"""The GRPO objective with an off-policy correction (`score_centering=False`).

    q_t = r_t = π_θ(o_t) / π_sampler(o_t)     (or GSPO's per-sequence g_s, losses/ratio.py)
    L   = -Σ_t c_t · min(q_t·A, clip(q_t, 1-ε_low, 1+ε_high)·A)

c_t is the correction's detached factor (losses/ratio.py): by default 1[C_min ≤ r_t ≤ C_max], masked importance
sampling. The sum is normalised by the caller (trained tokens of the micro-batch across ranks, then averaged over
accumulation steps).
"""

import torch

from tandem.losses.ratio import ImportanceSampling, TokenStats, importance_ratio


def clipped_surrogate(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    rule: ImportanceSampling,
    sequence: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TokenStats]:
    """Per-token losses (to be summed and normalised) and detached per-token statistics; `sequence` numbers each
    token's sample (None: one sample)."""
    ratio, stats = importance_ratio(log_probs, behavior_log_probs, rule, sequence)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - rule.epsilon_low, 1 + rule.epsilon_high) * advantages
    return -torch.minimum(unclipped, clipped) * stats.weight, stats
