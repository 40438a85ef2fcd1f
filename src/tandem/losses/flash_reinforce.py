"""FlashREINFORCE's reference loss (`flashreinforce/loss.py` in its public repository), standalone.

One rollout per prompt, the batch mean reward as the baseline, a detached and unclipped token ratio,
and the Sequence Trust Region gate: a trajectory takes part only if the mean Bernoulli KL between the
sampler's and the policy's probability of its own tokens is at most δ.

    A_i   = R_i - mean_j R_j
    d_it  = p log(p/q) + (1-p) log((1-p)/(1-q)),   p = μ(a_it), q = π_θ(a_it), both clamped to [1e-6, 1-1e-6]
    m_i   = 1[ (1/T_i) Σ_t d_it ≤ δ ]
    loss  = -(1/B) Σ_i (m_i A_i / T_i) Σ_t sg(ρ_it) log π_θ(a_it),   ρ_it = π_θ(a_it) / μ(a_it)

T_i and B are the original counts: rejected trajectories and filtered tokens stay in the denominators,
so a trajectory of 1 token and one of 9 carry the same total weight. With q < 1 (negative_token_fraction),
each explicitly failed trajectory keeps only its ceil(q·T_i) highest-entropy tokens.
"""

import math

import torch

PROB_CLAMP = 1e-6


def flash_reinforce_loss(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    delta: float = 3e-3,
    negative_token_fraction: float = 1.0,
    entropies: torch.Tensor | None = None,
    failures: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss (its gradient is the FlashREINFORCE update) and detached diagnostics.

    log_probs [B, T] (with autograd), behavior_log_probs [B, T], rewards [B], action_mask [B, T] bool (True on
    policy tokens: not prompt, tool output or padding). Each row is one complete trajectory.
    """
    _validate(log_probs, behavior_log_probs, rewards, action_mask, delta, negative_token_fraction, entropies, failures)
    dtype = torch.float64 if log_probs.dtype == torch.float64 else torch.float32
    mask = action_mask
    current = log_probs.to(dtype).masked_fill(~mask, 0.0)
    with torch.no_grad():
        behavior = behavior_log_probs.to(dtype).masked_fill(~mask, 0.0)
        rewards = rewards.to(dtype)
        advantages = rewards - rewards.mean()
        lengths = mask.sum(-1)
        sequence_kl = _sequence_kl(behavior, current.detach(), mask, lengths)
        admitted = sequence_kl <= delta
        kept = mask.clone()
        if negative_token_fraction < 1.0:
            kept &= _high_entropy_tokens(entropies, mask, failures, negative_token_fraction)
        active = kept & admitted[:, None]
        ratio = _active_ratio(current.detach(), behavior, active)
        weights = torch.where(active, ratio * advantages[:, None], torch.zeros_like(current))
    loss = -((weights * current).sum(-1) / lengths).mean()
    diagnostics = {
        "advantages": advantages,
        "sequence_kl": sequence_kl,
        "admitted": admitted,
        "acceptance_rate": admitted.to(dtype).mean(),
        "policy_tokens": lengths,
        "retained_tokens": active.sum(-1),
    }
    return loss, diagnostics


def _sequence_kl(
    behavior: torch.Tensor, current: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Each sequence's mean per-token KL between the sampler's and the policy's Bernoulli of the sampled token (its
    probabilities clamped away from 0 and 1), floored at 0."""
    p = behavior.exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    q = current.exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    kl = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    return ((kl * mask).sum(-1) / lengths).clamp(min=0.0)


def _active_ratio(current: torch.Tensor, behavior: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """The policy/behaviour ratio on active tokens (1 elsewhere); an overflow is an error."""
    ratio = torch.where(active, (current - behavior).exp(), torch.ones_like(current))
    if not torch.isfinite(ratio).all():
        raise FloatingPointError(
            "flash_reinforce_loss: the policy/behaviour ratio overflowed on an active token; "
            "the two log-probs are too far apart (check that behavior_log_probs are the sampler's)"
        )
    return ratio


def _high_entropy_tokens(entropies, mask, failures, fraction) -> torch.Tensor:
    """Keep every token of successful rows; in failed rows the ceil(q·T_i) highest-entropy policy tokens
    (ties to the earlier position)."""
    keep = torch.ones_like(mask)
    for row in torch.nonzero(failures).flatten().tolist():
        positions = torch.nonzero(mask[row]).flatten()
        count = math.ceil(fraction * positions.numel())
        order = torch.sort(entropies[row, positions], descending=True, stable=True).indices
        keep[row] = False
        keep[row, positions[order[:count]]] = True
    return keep


def _validate(log_probs, behavior_log_probs, rewards, action_mask, delta, fraction, entropies, failures) -> None:
    def fail(message):
        raise ValueError(f"flash_reinforce_loss: {message}")

    if log_probs.dim() != 2 or log_probs.numel() == 0:
        fail(f"log_probs must be a non-empty [batch, tokens] tensor, got shape {tuple(log_probs.shape)}")
    shape = log_probs.shape
    for name, tensor in (("behavior_log_probs", behavior_log_probs), ("action_mask", action_mask)):
        if tensor.shape != shape:
            fail(f"{name} has shape {tuple(tensor.shape)}, log_probs has {tuple(shape)}: they must match")
    if rewards.shape != (shape[0],):
        fail(f"rewards must have shape ({shape[0]},), one per row, got {tuple(rewards.shape)}")
    if action_mask.dtype != torch.bool:
        fail(f"action_mask must be bool, got {action_mask.dtype}")
    if not (log_probs.is_floating_point() and behavior_log_probs.is_floating_point()):
        fail("log_probs and behavior_log_probs must be floating point")
    devices = {t.device for t in (log_probs, behavior_log_probs, rewards, action_mask)}
    if len(devices) > 1:
        fail(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if math.isnan(delta) or delta < 0:
        fail(f"delta={delta}: the trust-region threshold must be >= 0 (use float('inf') to admit everything)")
    if not 0.0 <= fraction <= 1.0:
        fail(f"negative_token_fraction={fraction} must be in [0, 1]")
    empty = (~action_mask.any(-1)).nonzero().flatten().tolist()
    if empty:
        fail(f"rows {empty} have no policy token; drop them or fix action_mask")
    if not torch.isfinite(rewards).all():
        fail(f"rewards must be finite, got {rewards.tolist()}")
    for name, tensor in (("log_probs", log_probs), ("behavior_log_probs", behavior_log_probs)):
        values = tensor.detach()[action_mask]
        if not torch.isfinite(values).all():
            fail(f"{name} has NaN or infinite values on policy tokens")
        if (values > 0).any():
            fail(f"{name} has positive values on policy tokens (max {values.max().item():.3g}): log-probs are <= 0")
    if fraction < 1.0:
        if entropies is None or failures is None:
            fail(
                "negative_token_fraction < 1 filters failed trajectories by entropy: pass entropies [B, T] and failures [B]"
            )
        if failures.dtype != torch.bool:
            fail(
                f"failures must be an explicit bool label per row, got {failures.dtype} (not the sign of the advantage)"
            )
        if entropies.shape != shape or failures.shape != (shape[0],):
            fail(
                f"entropies must be {tuple(shape)} and failures ({shape[0]},), got {tuple(entropies.shape)} and {tuple(failures.shape)}"
            )
