"""The importance ratio every objective starts from, and which tokens its bounds mask or clip.

    r_t = π_θ(o_t) / π_sampler(o_t)                  (the sampler's log-probs are the behaviour policy)
    in_bounds_t    = C_min ≤ r_t ≤ C_max              (masked importance sampling: the token is trained)
    below_t        = r_t < 1-ε_low                    (outside the trust region, whatever the advantage's sign:
    above_t        = r_t > 1+ε_high                    clip_ratio/* counts them)

One ratio covers both the sampler/trainer mismatch and staleness. FlashREINFORCE neither masks nor
clips: `UNBOUNDED` gives its statistics (every token in bounds, none clipped).
"""

import math
from dataclasses import dataclass

import torch

UNBOUNDED = {"epsilon_low": math.inf, "epsilon_high": math.inf, "clip_min": -math.inf, "clip_max": math.inf}
"""Bounds that mask and clip nothing (FlashREINFORCE's unclipped ratio)."""


@dataclass
class TokenStats:
    ratio: torch.Tensor  # before masking, detached
    in_bounds: torch.Tensor  # the MIS mask
    below: torch.Tensor  # r < 1 - ε_low
    above: torch.Tensor  # r > 1 + ε_high


def importance_ratio(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    clip_min: float,
    clip_max: float,
) -> tuple[torch.Tensor, TokenStats]:
    """The per-token ratio (differentiable through `log_probs`) and its detached statistics."""
    ratio = torch.exp(log_probs - behavior_log_probs)
    detached = ratio.detach()
    stats = TokenStats(
        ratio=detached,
        in_bounds=(detached >= clip_min) & (detached <= clip_max),
        below=detached < 1 - epsilon_low,
        above=detached > 1 + epsilon_high,
    )
    return ratio, stats
