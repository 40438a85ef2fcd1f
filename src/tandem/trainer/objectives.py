"""The training objectives behind one interface: what a row's loss is, and what it records.

The trainer's step reads the same whatever the objective, on one rank or several:

    records = objective.begin_step(rows, score)          # once per optimizer step, before any forward
    for micro_batch in micro_batches:
        for row in this rank's rows of micro_batch:
            result = objective.row_loss(row, row_log_probs(model, row, ...), LossShare.of(micro_batch, ...))
            result.loss.backward()                        # records += result.metrics

`ClippedSurrogate` (`score_centering=False`) and `ScoreCentering` (the default) are
per-token losses normalised by the trained tokens of the whole micro-batch (every rank's rows) and averaged
over the micro-batches: summed over ranks, the gradient is one process's over the same rows. `FlashReinforce` is one
loss over the whole step: its `begin_step` scores every row of the step without gradients (`score` returns every
rank's) and fixes each token's coefficient c_t, then each row's loss is Σ_t c_t log π_θ(a_t), the row's share of the
update. Every objective adds the MoE router's load-balancing loss (`router_loss`), averaged over the step's rows.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.config import AsyncGRPOConfig
from tandem.contract.algorithms import algorithm_of
from tandem.errors import UsageError
from tandem.losses.flash_reinforce import flash_reinforce_loss
from tandem.losses.grpo import clipped_surrogate
from tandem.losses.ratio import UNBOUNDED, ImportanceSampling, TokenStats, importance_ratio, off_policy_stats
from tandem.losses.score_centering import score_centered
from tandem.packing.log_probs import TokenLogProbs
from tandem.packing.trie import PackedRow


@dataclass
class LossShare:
    """What a row's loss is divided by to be its share of the step's loss."""

    tokens: int  # the trained tokens of the row's micro-batch (all ranks' rows) x the step's micro-batches
    rows: int  # the rows of the step (per-row terms such as the MoE aux loss are averaged over them)

    @classmethod
    def of(cls, micro_batch: list[PackedRow], num_micro_batches: int) -> "LossShare":
        trained = sum(row.num_trained for row in micro_batch)
        return cls(max(trained, 1) * num_micro_batches, len(micro_batch) * num_micro_batches)


@dataclass
class RowLoss:
    loss: torch.Tensor  # scalar, differentiable: this row's share of the step's loss (the trainer backwards it)
    metrics: dict[str, list]  # window records {metric name: [values]}


class Objective:
    """The loss of each packed row of an optimizer step; ClippedSurrogate, ScoreCentering, FlashReinforce."""

    def begin_step(self, rows: list[PackedRow], score: Callable[[], list[TokenLogProbs]]) -> dict[str, list]:
        """Once per optimizer step, before any row's forward; `rows` are the step's rows on every rank, and `score()`
        their no-grad forwards, in the same order. Returns step-level metric records. Per-token objectives need
        nothing here (and never call `score`)."""
        return {}

    def row_loss(self, row: PackedRow, scored: TokenLogProbs, share: LossShare) -> RowLoss:
        """`scored` is the row's forward with gradients."""
        raise NotImplementedError


def router_loss(scored: TokenLogProbs, coefficient: float, share: LossShare) -> tuple[torch.Tensor | float, dict]:
    """A mixture-of-experts row's load-balancing loss, scaled by the coefficient (the model's own by default) and
    averaged over the step's rows, and its unscaled value as a record; (0, {}) for a model without a router or with
    a coefficient of 0 (`aux_loss` is logged only where it trains)."""
    if scored.aux_loss is None or not coefficient:
        return 0.0, {}
    return coefficient * scored.aux_loss / share.rows, {"aux_loss": [float(scored.aux_loss.detach())]}


class ClippedSurrogate(Objective):
    """GRPO's clipped surrogate with masked importance sampling (losses/grpo.py)."""

    def __init__(self, rule: ImportanceSampling, aux_loss_coef: float):
        self.rule = rule
        self.aux_loss_coef = aux_loss_coef

    @classmethod
    def from_config(cls, args: AsyncGRPOConfig, aux_loss_coef: float) -> "ClippedSurrogate":
        rule = ImportanceSampling(
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
            clip_min=args.vllm_importance_sampling_clip_min,
            clip_max=args.vllm_importance_sampling_clip_max,
            mode=args.vllm_importance_sampling_mode,
            level=args.importance_sampling_level,
        )
        return cls(rule, aux_loss_coef)

    def token_losses(
        self, row: PackedRow, scored: TokenLogProbs, behavior: torch.Tensor, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, TokenStats, dict[str, list]]:
        """Per-token losses, their statistics and any objective-specific records."""
        losses, stats = clipped_surrogate(scored.log_probs, behavior, advantages, self.rule, row.term_sample)
        return losses, stats, {}

    def row_loss(self, row: PackedRow, scored: TokenLogProbs, share: LossShare) -> RowLoss:
        device = scored.log_probs.device
        behavior, advantages = row.behavior_log_probs.to(device), row.advantages.to(device)
        losses, stats, metrics = self.token_losses(row, scored, behavior, advantages)
        # Normalised by the trained tokens of the micro-batch, then averaged over the accumulated micro-batches.
        router, recorded = router_loss(scored, self.aux_loss_coef, share)
        loss = losses.sum() / share.tokens + router
        return RowLoss(
            loss, metrics | recorded | token_stats(row, scored.log_probs.detach(), behavior, scored.entropy, stats)
        )


class ScoreCentering(ClippedSurrogate):
    """Score centering (losses/score_centering.py): the surrogate's normalisation, aux loss and statistics,
    with the importance-weighted score centred over the sampler's top `num_sampler_logprobs` tokens."""

    def token_losses(
        self, row: PackedRow, scored: TokenLogProbs, behavior: torch.Tensor, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, TokenStats, dict[str, list]]:
        if row.sampler_ids is None:
            raise UsageError(
                "score_centering=True needs the sampler's top log-probs of every sampled token, and these "
                "samples have none: a custom generate_one/generate_one_turn must request "
                "logprobs=num_sampler_logprobs (or set score_centering=False)"
            )
        assert row.sampler_logprobs is not None and scored.extra is not None, "set with the sampler's ids, and scored"
        sampler_logprobs = row.sampler_logprobs.to(behavior.device)
        losses, stats, mass = score_centered(
            scored.log_probs, behavior, advantages, scored.extra, sampler_logprobs, self.rule, row.term_sample
        )
        return losses, stats, {"sampling/sampler_mass": mass.tolist()}


class FlashReinforce(Objective):
    """FlashREINFORCE over the whole optimizer batch: its update is
    Σ_t c_t ∇log π_θ(a_t) with every c_t detached, c_t being the gradient of the reference loss
    (losses/flash_reinforce.py) with respect to the current log-prob of token t. A multi-turn rollout is one
    trajectory whatever rows its samples landed in. It neither clips nor masks; a mixture of experts' router loss is
    added to each row's as in GRPO."""

    def __init__(self, delta: float, negative_token_fraction: float, aux_loss_coef: float = 0.0):
        self.delta = delta
        self.negative_token_fraction = negative_token_fraction
        self.aux_loss_coef = aux_loss_coef
        self.coefficients: dict[int, torch.Tensor] = {}
        """c_t of each row of the current step, by id(row); set by begin_step, taken by row_loss."""

    @classmethod
    def from_config(cls, args: AsyncGRPOConfig, aux_loss_coef: float) -> "FlashReinforce":
        return cls(args.flash_delta, args.flash_negative_token_fraction, aux_loss_coef)

    def begin_step(self, rows: list[PackedRow], score: Callable[[], list[TokenLogProbs]]) -> dict[str, list]:
        scored = score()
        device = scored[0].log_probs.device
        layout = TrajectoryLayout.of(rows, device)
        current = layout.scatter(torch.cat([s.log_probs for s in scored])).requires_grad_(True)
        behavior = layout.scatter(torch.cat([row.behavior_log_probs for row in rows]).to(device))
        entropies = layout.scatter(torch.cat([s.entropy for s in scored]))
        rewards = layout.rewards.to(current.dtype)
        loss, diagnostics = flash_reinforce_loss(
            current,
            behavior.clamp(max=0.0),
            rewards,
            layout.mask,
            delta=self.delta,
            negative_token_fraction=self.negative_token_fraction,
            entropies=entropies,
            failures=rewards <= 0,
        )
        (gradient,) = torch.autograd.grad(loss, current)
        self.coefficients = {id(row): c for row, c in zip(rows, layout.gather(gradient))}
        kl, retained, policy = diagnostics["sequence_kl"], diagnostics["retained_tokens"], diagnostics["policy_tokens"]
        return {
            "flash/acceptance_rate": [float(diagnostics["acceptance_rate"])],
            "flash/sequence_kl_mean": kl.tolist(),
            "flash/sequence_kl_max": [float(kl.max())],
            "flash/retained_tokens_frac": [float(retained.sum() / policy.sum())],
        }

    def row_loss(self, row: PackedRow, scored: TokenLogProbs, share: LossShare) -> RowLoss:
        if id(row) not in self.coefficients:
            raise RuntimeError("FlashReinforce.row_loss: this row was not among the rows passed to begin_step")
        log_probs = scored.log_probs
        router, recorded = router_loss(scored, self.aux_loss_coef, share)
        loss = (self.coefficients.pop(id(row)) * log_probs).sum() + router
        behavior = row.behavior_log_probs.to(log_probs.device)
        _, stats = importance_ratio(log_probs.detach(), behavior, UNBOUNDED, row.term_sample)
        return RowLoss(loss, recorded | token_stats(row, log_probs.detach(), behavior, scored.entropy, stats))


OBJECTIVES: dict[str, type[ClippedSurrogate] | type[FlashReinforce]] = {
    "clipped_surrogate": ClippedSurrogate,
    "score_centering": ScoreCentering,
    "flash_reinforce": FlashReinforce,
}
"""Each objective by the name an algorithm gives it (tandem/contract/algorithms.py)."""


def make_objective(args: AsyncGRPOConfig, aux_loss_coef: float) -> Objective:
    """The objective of the algorithm `args` chooses."""
    return OBJECTIVES[algorithm_of(args).objective(args)].from_config(args, aux_loss_coef)


def token_stats(
    row: PackedRow, log_probs: torch.Tensor, behavior: torch.Tensor, entropy: torch.Tensor, stats: TokenStats
) -> dict[str, list]:
    """The loss and sampling diagnostics over a row's trained tokens."""
    diff = (log_probs - behavior).abs()
    low, high = stats.below.float().cpu(), stats.above.float().cpu()
    return off_policy_stats(stats) | {
        "sampling/sampling_logp_difference/mean": diff.tolist(),
        "sampling/sampling_logp_difference/max": [float(diff.max())],
        "sampling/importance_sampling_ratio/min": [float(stats.ratio.min())],
        "sampling/importance_sampling_ratio/mean": stats.ratio.tolist(),
        "sampling/importance_sampling_ratio/max": [float(stats.ratio.max())],
        "sampling/masked_mean": (~stats.in_bounds).float().tolist(),
        "entropy": entropy.tolist(),
        "clip_ratio/low_mean": low.tolist(),
        "clip_ratio/high_mean": high.tolist(),
        "clip_ratio/region_mean": (low + high).tolist(),
        "clip_ratio/low_min": [float(_per_sample_mean(row, low).min())],
        "clip_ratio/high_max": [float(_per_sample_mean(row, high).max())],
    }


def _per_sample_mean(row: PackedRow, values: torch.Tensor) -> torch.Tensor:
    """Each sample's mean of a per-term value of the row (a sample without terms reads 0)."""
    counts = torch.zeros(len(row.samples)).index_add_(0, row.term_sample, torch.ones(row.num_trained))
    return torch.zeros(len(row.samples)).index_add_(0, row.term_sample, values) / counts.clamp(min=1)


@dataclass
class TrajectoryLayout:
    """Where each loss term of a step's rows sits in a [trajectories, tokens] batch. Terms are numbered
    across the rows in order (row 0's terms, then row 1's, ...); a trajectory is a rollout (`rollout_id`),
    whatever rows its samples landed in, and its tokens keep that order."""

    trajectory: torch.Tensor  # [M] trajectory of each term
    position: torch.Tensor  # [M] index of the term within its trajectory
    rewards: torch.Tensor  # [B] each trajectory's reward
    row_sizes: list[int]  # terms per row
    width: int  # tokens of the longest trajectory

    @classmethod
    def of(cls, rows: list[PackedRow], device: torch.device) -> "TrajectoryLayout":
        numbers: dict[str, int] = {}  # rollout id -> trajectory, in order of first trained term
        rewards: dict[str, float] = {}
        per_row = []
        for row in rows:
            has_terms = torch.bincount(row.term_sample, minlength=len(row.samples)).tolist()
            for sample, terms in zip(row.samples, has_terms):
                if terms:
                    numbers.setdefault(sample.rollout_id, len(numbers))
                rewards[sample.rollout_id] = sample.reward
            sample_trajectory = torch.tensor([numbers.get(s.rollout_id, -1) for s in row.samples], dtype=torch.long)
            per_row.append(sample_trajectory[row.term_sample])
        trajectory = torch.cat(per_row).to(device)
        counts = torch.bincount(trajectory, minlength=len(numbers))
        # A stable sort groups the terms by trajectory, keeping their order; each group starts at the counts before it.
        order = torch.sort(trajectory, stable=True).indices
        starts = counts.cumsum(0) - counts
        position = torch.empty_like(trajectory)
        position[order] = torch.arange(trajectory.numel(), device=device) - starts[trajectory[order]]
        return cls(
            trajectory,
            position,
            torch.tensor([rewards[r] for r in numbers], dtype=torch.float64, device=device),
            [row.num_trained for row in rows],
            int(counts.max()),
        )

    @property
    def mask(self) -> torch.Tensor:
        """[B, width] True on the tokens of each trajectory."""
        return self.scatter(torch.ones(self.trajectory.numel(), dtype=torch.bool, device=self.trajectory.device))

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[M] per-term values -> [B, width], zero (False) past each trajectory's end."""
        batch = values.new_zeros(len(self.rewards), self.width)
        batch[self.trajectory, self.position] = values
        return batch

    def gather(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """[B, width] -> each row's [N] values, in the row's term order."""
        return list(batch[self.trajectory, self.position].split(self.row_sizes))
