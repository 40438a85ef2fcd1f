"""The importance ratio every objective starts from, and the off-policy correction that weighs each token.

    d_t = log π_θ(o_t) - log μ(o_t)          μ: the sampler, whose log-probs came with the sample
    r_t = exp(d_t)                            the token's ratio: the sampler/trainer mismatch and staleness in one
    ρ_s = exp(Σ_{t∈s} d_t)                    a sequence's ratio (s: the trained tokens of one sample)
    g_s = exp(Σ_{t∈s} d_t / |s|)              its geometric mean per token

The ratio the trust region clips, q_t (`importance_sampling_level`): r_t ("token"), or g_s for every token of s
("sequence": GSPO's sequence-level ratio, differentiable through all of s's tokens).

The correction (`vllm_importance_sampling_mode`) multiplies each token's loss by a detached c_t in [0, 1], so that the
token's weight in the gradient is c_t·r_t:

    token_mask          c_t = 1[C_min ≤ r_t ≤ C_max]      (default: masked importance sampling)
    token_truncate      c_t = min(1, C_max / r_t)         (the weight is min(r_t, C_max): truncated IS)
    sequence_mask       c_t = 1[C_min ≤ ρ_s ≤ C_max]
    sequence_truncate   c_t = min(1, C_max / ρ_s)
    geometric_mask      c_t = 1[C_min ≤ g_s ≤ C_max]      (a sequence mask whose bound does not tighten with |s|)

    below_t = q_t < 1-ε_low,  above_t = q_t > 1+ε_high    (outside the trust region, whatever the advantage's sign:
                                                           clip_ratio/* counts them)

FlashREINFORCE neither masks nor clips: `UNBOUNDED` gives its statistics (every token kept, none clipped).
"""

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImportanceSampling:
    """How a token's ratio enters the loss: the trust region, the correction and the ratio's level."""

    epsilon_low: float
    epsilon_high: float
    clip_min: float
    clip_max: float
    mode: str = "token_mask"
    level: str = "token"

    @property
    def per_sequence(self) -> bool:
        """Whether the correction judges a whole sequence (then a sequence's tokens share one c_t)."""
        return not self.mode.startswith("token_")

    def factor(self, ratio: torch.Tensor) -> torch.Tensor:
        """c from a detached ratio (r_t, ρ_s or g_s, by the mode)."""
        if self.mode.endswith("_truncate"):
            return torch.clamp(self.clip_max / ratio, max=1.0)
        return ((ratio >= self.clip_min) & (ratio <= self.clip_max)).to(ratio.dtype)


UNBOUNDED = ImportanceSampling(epsilon_low=math.inf, epsilon_high=math.inf, clip_min=-math.inf, clip_max=math.inf)
"""Bounds that mask and clip nothing (FlashREINFORCE's unclipped ratio)."""


@dataclass
class TokenStats:
    ratio: torch.Tensor  # r_t, detached
    weight: torch.Tensor  # c_t, the correction's factor (0 where masked), detached
    below: torch.Tensor  # q_t < 1 - ε_low
    above: torch.Tensor  # q_t > 1 + ε_high
    in_bounds: torch.Tensor  # C_min ≤ r_t ≤ C_max, whatever the mode (sampling/masked_mean counts the rest)
    sequence: torch.Tensor  # [N] the sequence of each token
    log_ratio: torch.Tensor  # d_t, detached


def sequence_sums(values: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
    """[S] the sum of each sequence's values (sequences numbered 0..S-1 in `sequence`)."""
    size = int(sequence.max()) + 1 if sequence.numel() else 0
    return values.new_zeros(size).index_add_(0, sequence, values)


def importance_ratio(
    log_probs: torch.Tensor,
    behavior_log_probs: torch.Tensor,
    rule: ImportanceSampling,
    sequence: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TokenStats]:
    """q_t (differentiable through `log_probs`) and the detached statistics, c_t among them. `sequence` numbers each
    token's sequence (the sample it belongs to); None: all tokens are one sequence."""
    sequence = torch.zeros_like(log_probs, dtype=torch.long) if sequence is None else sequence.to(log_probs.device)
    log_ratio = log_probs - behavior_log_probs
    detached = log_ratio.detach()
    ratio = torch.exp(detached)
    lengths = sequence_sums(torch.ones_like(detached), sequence).clamp(min=1)
    if rule.level == "sequence":
        q = torch.exp((sequence_sums(log_ratio, sequence) / lengths)[sequence])
    else:
        q = torch.exp(log_ratio)
    if rule.per_sequence:
        sums = sequence_sums(detached, sequence)
        weight = rule.factor(torch.exp(sums / lengths if rule.mode == "geometric_mask" else sums))[sequence]
    else:
        weight = rule.factor(ratio)
    stats = TokenStats(
        ratio=ratio,
        weight=weight,
        below=q.detach() < 1 - rule.epsilon_low,
        above=q.detach() > 1 + rule.epsilon_high,
        in_bounds=(ratio >= rule.clip_min) & (ratio <= rule.clip_max),
        sequence=sequence,
        log_ratio=detached,
    )
    return q, stats


def off_policy_stats(stats: TokenStats) -> dict[str, list]:
    """How far the sampler is from the trainer over these tokens, and what the correction left out:

    effective_sample_size = (Σ r)² / (N·Σ r²)     1 when every r_t is 1; recorded as (Σ r, Σ r², N), pooled per window
    mismatch_kl           = mean(r - 1 - d)        the k3 estimate of KL(μ ‖ π_θ), 0 when they agree
    masked_tokens_frac    = share of tokens with c_t = 0
    masked_sequences_frac = share of sequences all of whose tokens have c_t = 0
    """
    ratio = stats.ratio.double()
    masked = (stats.weight == 0).double()
    lengths = sequence_sums(torch.ones_like(masked), stats.sequence)
    fully_masked = sequence_sums(masked, stats.sequence) == lengths
    present = lengths > 0
    return {
        "sampling/effective_sample_size": [(float(ratio.sum()), float((ratio**2).sum()), ratio.numel())],
        "sampling/mismatch_kl": (ratio - 1 - stats.log_ratio.double()).tolist(),
        "sampling/masked_tokens_frac": masked.tolist(),
        "sampling/masked_sequences_frac": fully_masked[present].double().tolist(),
    }
