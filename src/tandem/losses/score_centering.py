"""Score centering (the default objective, `score_centering=True`).

    ∇L = -E_{o~μ}[ A · ( f(r_o) ∇log π_θ(o) - E_{v~μ}[ f(r_v) ∇log π_θ(v) ] ) ],   r_v = π_θ(v) / μ(v)
    f(r) = c·r, c the correction's factor (losses/ratio.py): by default 1 inside [C_min, C_max], 0 outside

The importance-weighted score of a sampled token does not average to zero under the sampler μ, so on
its own every update also pulls π_θ toward μ; subtracting its expectation at each position removes that.
The inner expectation runs over the sampler's top `num_sampler_logprobs` tokens at the position.

A surrogate with exactly that gradient, per token: since ∇r = r ∇log π and μ(v)·r_v = π_θ(v),
    loss_t = -A · ( c_t · r_t  -  Σ_{v in top-K} c_v · π_θ(v) )      (c detached)
A token-level correction judges each alternative v by its own ratio r_v; a sequence-level one gives every v at a
position the sampled token's factor (the sequence is the one sampled).
"""

import torch

from tandem.losses.ratio import ImportanceSampling, TokenStats, importance_ratio

SAMPLER_FLOOR = -9999.0
"""vLLM reports log-probs of impossible tokens (outside a top-k / top-p set) as -9999.0: they have no mass."""


def score_centered(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    top_log_probs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    rule: ImportanceSampling,
    sequence: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TokenStats, torch.Tensor]:
    """Per-token losses, detached statistics and the sampler mass of each position's top-K.

    log_probs / behavior_log_probs / advantages: [N] for the sampled tokens (policy, sampler, advantage);
    top_log_probs / sampler_logprobs: [N, K] policy and sampler log-probs of the sampler's top-K tokens,
    with -inf (or vLLM's -9999.0 floor) in the sampler's entries where a position has fewer than K;
    `sequence` numbers each token's sample (None: one sample).
    """
    if rule.level != "token":
        raise ValueError(
            "score centering weighs each token by its own ratio: importance_sampling_level must be 'token'"
        )
    ratio, stats = importance_ratio(log_probs, behavior_log_probs, rule, sequence)
    present = sampler_logprobs > SAMPLER_FLOOR
    top_probs = torch.exp(top_log_probs.masked_fill(~present, float("-inf")))
    if rule.per_sequence:
        top_weight = stats.weight[:, None].expand_as(top_probs)
    else:
        top_weight = rule.factor((top_probs.detach() / torch.exp(sampler_logprobs)).masked_fill(~present, 0.0))
    expectation = (top_probs * top_weight * present).sum(-1)
    losses = -advantages * (ratio * stats.weight - expectation)
    return losses, stats, torch.exp(sampler_logprobs).masked_fill(~present, 0.0).sum(-1)
