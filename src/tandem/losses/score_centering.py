"""Score centering (the default objective, `score_centering=True`).

    ∇L = -E_{o~μ}[ A · ( f(r_o) ∇log π_θ(o) - E_{v~μ}[ f(r_v) ∇log π_θ(v) ] ) ],   r_v = π_θ(v) / μ(v)
    f(r) = r inside [C_min, C_max], 0 outside

The importance-weighted score of a sampled token does not average to zero under the sampler μ, so on
its own every update also pulls π_θ toward μ; subtracting its expectation at each position removes that.
The inner expectation runs over the sampler's top `num_sampler_logprobs` tokens at the position.

A surrogate with exactly that gradient, per token: since ∇r = r ∇log π and μ(v)·r_v = π_θ(v),
    loss_t = -A · ( m_t · r_t  -  Σ_{v in top-K} m_v · π_θ(v) ),     m = 1[C_min ≤ r ≤ C_max] (detached)
"""

import torch

from tandem.losses.ratio import TokenStats, importance_ratio

SAMPLER_FLOOR = -9999.0
"""vLLM reports log-probs of impossible tokens (outside a top-k / top-p set) as -9999.0: they have no mass."""


def score_centered(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    top_log_probs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    clip_min: float,
    clip_max: float,
) -> tuple[torch.Tensor, TokenStats, torch.Tensor]:
    """Per-token losses, detached statistics and the sampler mass of each position's top-K.

    log_probs / behavior_log_probs / advantages: [N] for the sampled tokens (policy, sampler, advantage);
    top_log_probs / sampler_logprobs: [N, K] policy and sampler log-probs of the sampler's top-K tokens,
    with -inf (or vLLM's -9999.0 floor) in the sampler's entries where a position has fewer than K.
    """
    ratio, stats = importance_ratio(
        log_probs,
        behavior_log_probs,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        clip_min=clip_min,
        clip_max=clip_max,
    )
    present = sampler_logprobs > SAMPLER_FLOOR
    top_probs = torch.exp(top_log_probs.masked_fill(~present, float("-inf")))
    top_ratio = (top_probs.detach() / torch.exp(sampler_logprobs)).masked_fill(~present, 0.0)
    top_in_bounds = present & (top_ratio >= clip_min) & (top_ratio <= clip_max)
    expectation = (top_probs * top_in_bounds).sum(-1)
    losses = -advantages * (ratio * stats.in_bounds - expectation)
    return losses, stats, torch.exp(sampler_logprobs).masked_fill(~present, 0.0).sum(-1)
