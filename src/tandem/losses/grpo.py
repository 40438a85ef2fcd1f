"""The GRPO objective with masked importance sampling (`score_centering=False`).

    r_t = π_θ(o_t) / π_sampler(o_t)                      (the sampler's log-probs are the behaviour policy)
    L   = -Σ_t 1[C_min ≤ r_t ≤ C_max] · min(r_t·A, clip(r_t, 1-ε_low, 1+ε_high)·A)

Tokens whose ratio falls outside [C_min, C_max] are masked out (MIS); the sum is normalised by the
caller (trained tokens of the micro-batch across ranks, then averaged over accumulation steps).
"""

import torch

from tandem.losses.ratio import TokenStats, importance_ratio


def clipped_surrogate(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    clip_min: float,
    clip_max: float,
) -> tuple[torch.Tensor, TokenStats]:
    """Per-token losses (to be summed and normalised) and detached per-token statistics."""
    ratio, stats = importance_ratio(
        log_probs,
        behavior_log_probs,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        clip_min=clip_min,
        clip_max=clip_max,
    )
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages
    return -torch.minimum(unclipped, clipped) * stats.in_bounds, stats
