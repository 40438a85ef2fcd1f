"""The objectives a training step uses, on packed rows with hand-chosen log-probs: each loss and gradient
against its formula (float64), the exact metric names each one records, and FlashREINFORCE's
[trajectories, tokens] rearrangement against a token-by-token reference."""

import math
import random

import pytest
import torch

from tandem.config import AsyncGRPOConfig
from tandem.contract.records import Sample
from tandem.losses import flash_reinforce_loss
from tandem.losses.ratio import ImportanceSampling
from tandem.packing import pack
from tandem.packing.log_probs import TokenLogProbs
from tandem.trainer.objectives import ClippedSurrogate, FlashReinforce, LossShare, ScoreCentering, make_objective

F64 = torch.float64
RULE = ImportanceSampling(epsilon_low=0.2, epsilon_high=0.28, clip_min=0.5, clip_max=5.0)
TOKEN_STATS = {
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/masked_mean",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "sampling/effective_sample_size",
    "sampling/mismatch_kl",
    "sampling/masked_tokens_frac",
    "sampling/masked_sequences_frac",
}
FLASH_STEP = {"flash/acceptance_rate", "flash/sequence_kl_mean", "flash/sequence_kl_max", "flash/retained_tokens_frac"}


def turn(rollout, ids, trained, *, advantage=1.0, reward=0.0, behavior_log_probs=None, top=None) -> Sample:
    """A sample of rollout `rollout` (one turn of it, for a multi-turn rollout)."""
    return Sample(
        input_ids=list(ids),
        trained=[bool(t) for t in trained],
        behavior_log_probs=behavior_log_probs or [-0.5] * len(ids),
        advantage=advantage,
        model_version=0,
        group_id=0,
        prompt_index=0,
        group_samples=1,
        rollout_id=rollout,
        created_at=0.0,
        sampler_logprobs=top or [],
        reward=reward,
    )


def scored(logprobs, entropy=None, extra=None, aux_loss=None) -> TokenLogProbs:
    """What the trainer's forward returns: log-probs (and the top-K's, and the router loss) with gradients."""
    logprobs = torch.tensor(logprobs, dtype=F64, requires_grad=True)
    return TokenLogProbs(
        logprobs,
        torch.full_like(logprobs, 0.3) if entropy is None else torch.tensor(entropy, dtype=F64),
        None if extra is None else torch.tensor(extra, dtype=F64, requires_grad=True),
        None if aux_loss is None else torch.tensor(aux_loss, dtype=F64, requires_grad=True),
    )


def no_scoring():
    raise AssertionError("a per-token objective scores nothing ahead of the rows")


# ---- the clipped surrogate and score centering ------------------------------------------------------
def two_sample_row():
    """Sample 0 trains 3 tokens (A = 1), sample 1 trains 2 (A = -1); sampler log-probs -0.5, -1, -0.25, -2, -0.5."""
    return pack(
        [
            turn("a", [1, 2, 3, 4], [0, 1, 1, 1], advantage=1.0, behavior_log_probs=[0.0, -0.5, -1.0, -0.25]),
            turn("b", [5, 6, 7], [0, 1, 1], advantage=-1.0, behavior_log_probs=[0.0, -2.0, -0.5]),
        ]
    )


RATIOS = [
    1.1,
    0.4,
    1.5,
    0.7,
    0.9,
]  # in bounds; masked (< C_min); above 1+ε_high with A > 0; below 1-ε_low with A < 0; inside


def test_clipped_surrogate_is_the_masked_clipped_ratio_over_trained_tokens_and_rows():
    row = two_sample_row()
    old, advantages = row.behavior_log_probs.double(), row.advantages.double()
    forward = scored((old + torch.tensor(RATIOS, dtype=F64).log()).tolist())
    result = ClippedSurrogate(RULE, aux_loss_coef=0.1).row_loss(row, forward, LossShare(tokens=5 * 2, rows=2))
    result.loss.backward()
    ratio = torch.tensor(RATIOS, dtype=F64)
    clipped = ratio.clamp(0.8, 1.28)
    in_bounds = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0], dtype=F64)
    expected = -(in_bounds * torch.minimum(ratio * advantages, clipped * advantages)).sum() / 5 / 2
    assert result.loss.item() == pytest.approx(expected.item(), abs=1e-12)
    # d/dlog π: -r·A where the unclipped term is the minimum, 0 where the clip is active or the token masked
    assert torch.allclose(forward.log_probs.grad, torch.tensor([-1.1, 0.0, 0.0, 0.0, 0.9], dtype=F64) / 10, atol=1e-12)
    assert set(result.metrics) == TOKEN_STATS
    metrics = result.metrics
    assert metrics["sampling/masked_mean"] == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert metrics["clip_ratio/high_mean"] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert metrics["clip_ratio/low_mean"] == [0.0, 1.0, 0.0, 1.0, 0.0], "a masked token is outside the region too"
    assert metrics["clip_ratio/low_min"] == [pytest.approx(1 / 3)] and metrics["clip_ratio/high_max"] == [
        pytest.approx(1 / 3)
    ]
    assert metrics["sampling/importance_sampling_ratio/max"] == [pytest.approx(1.5)]
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx([abs(math.log(r)) for r in RATIOS])


def test_score_centering_subtracts_the_top_k_expectation():
    tops = [None, {1: -0.5, 9: -1.5}, {1: -1.0, 9: -0.7}, {1: -0.25, 9: -9999.0}]  # vLLM's floor: no mass
    row = pack(
        [turn("a", [1, 2, 3, 4], [0, 1, 1, 1], advantage=2.0, behavior_log_probs=[0.0, -0.5, -1.0, -0.25], top=tops)]
    )
    top_sampler = row.sampler_logprobs.double()
    # policy log-probs of the top-K: ratios 1.2 (in), 6.0 (out of [C_min, C_max]); 0.9, 0.6; 1.0, whatever
    top_policy = top_sampler + torch.tensor([[1.2, 6.0], [0.9, 0.6], [1.0, 1.0]], dtype=F64).log()
    top_policy[2, 1] = -3.0
    forward = scored([-0.5 + math.log(1.2), -1.0 + math.log(0.9), -0.25], extra=top_policy.tolist())
    result = ScoreCentering(RULE, aux_loss_coef=0.0).row_loss(row, forward, LossShare.of([row], 1))
    result.loss.backward()
    ratio = torch.tensor([1.2, 0.9, 1.0], dtype=F64)  # every sampled token in bounds
    kept_top = torch.tensor([[1, 0], [1, 1], [1, 0]], dtype=F64) * top_policy.exp()  # m_v·π(v)
    expected = (-2.0 * (ratio - kept_top.sum(-1))).sum() / 3  # loss_t = -A·(m_t·r_t - Σ_v m_v·π(v))
    assert result.loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert torch.allclose(forward.log_probs.grad, -2.0 * ratio / 3, atol=1e-12)
    assert torch.allclose(forward.extra.grad, 2.0 * kept_top / 3, atol=1e-12)
    assert set(result.metrics) == TOKEN_STATS | {"sampling/sampler_mass"}
    assert result.metrics["sampling/sampler_mass"] == pytest.approx(
        [math.exp(-0.5) + math.exp(-1.5), math.exp(-1.0) + math.exp(-0.7), math.exp(-0.25)]
    )


def test_score_centering_without_the_samplers_top_logprobs_names_the_fix():
    row = two_sample_row()
    with pytest.raises(ValueError, match="logprobs=num_sampler_logprobs .or set score_centering=False"):
        ScoreCentering(RULE, aux_loss_coef=0.0).row_loss(row, scored([-0.5] * 5), LossShare.of([row], 1))


@pytest.mark.parametrize("objective", [ClippedSurrogate, ScoreCentering])
def test_the_router_loss_is_added_scaled_per_row_and_recorded_unscaled(objective):
    tops = [None, {2: -0.5}, {3: -1.0}]
    row = pack([turn("a", [1, 2, 3], [0, 1, 1], advantage=0.0, behavior_log_probs=[0.0, -0.5, -1.0], top=tops)])
    forward = scored([-0.5, -1.0], extra=[[-0.5], [-1.0]], aux_loss=2.5)
    result = objective(RULE, aux_loss_coef=0.1).row_loss(row, forward, LossShare(tokens=2 * 4, rows=4))
    result.loss.backward()
    assert result.loss.item() == pytest.approx(0.1 * 2.5 / 4, abs=1e-12)  # A = 0: the router loss alone
    assert forward.aux_loss.grad.item() == pytest.approx(0.1 / 4)
    assert result.metrics["aux_loss"] == [2.5]
    without = objective(RULE, aux_loss_coef=0.1).row_loss(
        row, scored([-0.5, -1.0], extra=[[-0.5], [-1.0]]), LossShare(tokens=2 * 4, rows=4)
    )
    assert "aux_loss" not in without.metrics and without.loss.item() == 0.0
    off = objective(RULE, aux_loss_coef=0.0).row_loss(
        row, scored([-0.5, -1.0], extra=[[-0.5], [-1.0]], aux_loss=2.5), LossShare(tokens=2 * 4, rows=4)
    )
    assert "aux_loss" not in off.metrics, "router_aux_loss_coef 0: the router loss trains nothing and is not logged"


@pytest.mark.parametrize("objective", [ClippedSurrogate(RULE, 0.0), ScoreCentering(RULE, 0.0)])
def test_per_token_objectives_need_nothing_before_the_rows(objective):
    assert objective.begin_step([two_sample_row()], no_scoring) == {}


def test_make_objective_follows_the_config(tmp_path):
    grpo = make_objective(
        AsyncGRPOConfig(output_dir=str(tmp_path), score_centering=False, epsilon=0.1, epsilon_high=0.3),
        aux_loss_coef=0.01,
    )
    assert type(grpo) is ClippedSurrogate and grpo.aux_loss_coef == 0.01
    assert grpo.rule == ImportanceSampling(epsilon_low=0.1, epsilon_high=0.3, clip_min=0.5, clip_max=5.0)
    assert type(make_objective(AsyncGRPOConfig(output_dir=str(tmp_path)), 0.0)) is ScoreCentering
    flash = make_objective(
        AsyncGRPOConfig(output_dir=str(tmp_path), algorithm="flash_reinforce", num_generations=1, flash_delta=0.01), 0.0
    )
    assert type(flash) is FlashReinforce and flash.delta == 0.01


# ---- FlashREINFORCE ---------------------------------------------------------------------------------
def test_flash_reinforce_treats_a_multi_turn_rollout_as_one_trajectory_across_rows():
    """Rollout "m" has two turns in two rows (3 + 2 trained tokens), "s" one turn of 1 token. With every
    trajectory admitted, c_t = -(A_i·ρ_t / T_i) / B with A_i = R_i - mean R, T_i the trajectory's tokens."""
    first = turn("m", [1, 2, 3, 4], [0, 1, 1, 1], reward=1.0, behavior_log_probs=[0.0, -0.5, -1.0, -0.25])
    second = turn(
        "m", [1, 2, 3, 4, 7, 8, 9], [0, 0, 0, 0, 0, 1, 1], reward=1.0, behavior_log_probs=[0.0] * 5 + [-0.5, -2.0]
    )
    rows = [pack([first]), pack([second, turn("s", [5, 6], [0, 1], reward=0.0, behavior_log_probs=[0.0, -0.75])])]
    ratios = {id(rows[0]): [1.1, 0.9, 1.0], id(rows[1]): [1.2, 0.8, 1.05]}
    forwards = {
        id(r): scored((r.behavior_log_probs.double() + torch.tensor(ratios[id(r)], dtype=F64).log()).tolist())
        for r in rows
    }
    objective = FlashReinforce(delta=float("inf"), negative_token_fraction=1.0)
    records = objective.begin_step(rows, lambda: [forwards[id(row)] for row in rows])
    assert set(records) == FLASH_STEP and records["flash/acceptance_rate"] == [1.0]
    assert len(records["flash/sequence_kl_mean"]) == 2  # two trajectories, not three samples
    expected = {
        id(rows[0]): [-0.5 * r / 5 / 2 for r in ratios[id(rows[0])]],
        id(rows[1]): [-0.5 * r / 5 / 2 for r in ratios[id(rows[1])][:2]] + [0.5 * 1.05 / 1 / 2],
    }
    for row in rows:
        forward = forwards[id(row)]
        result = objective.row_loss(row, forward, LossShare.of(rows, 1))
        result.loss.backward()
        assert torch.allclose(forward.log_probs.grad, torch.tensor(expected[id(row)], dtype=F64), atol=1e-12)
        assert set(result.metrics) == TOKEN_STATS
        assert result.metrics["sampling/masked_mean"] == [0.0] * row.num_trained, "FlashREINFORCE masks nothing"
        assert result.metrics["clip_ratio/region_mean"] == [0.0] * row.num_trained, "and clips nothing"
        assert result.metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(ratios[id(row)])


def test_flash_reinforce_adds_the_router_loss_as_grpo_does():
    """A mixture of experts trained with FlashREINFORCE keeps its routers balanced: the same scaled, per-row term."""
    row = pack([turn("a", [1, 2, 3], [0, 1, 1], reward=1.0, behavior_log_probs=[0.0, -0.5, -1.0])])
    objective = FlashReinforce(delta=float("inf"), negative_token_fraction=1.0, aux_loss_coef=0.1)
    objective.begin_step([row], lambda: [scored([-0.5, -1.0])])
    forward = scored([-0.5, -1.0], aux_loss=2.5)
    result = objective.row_loss(row, forward, LossShare(tokens=2 * 4, rows=4))
    result.loss.backward()
    assert forward.aux_loss.grad.item() == pytest.approx(0.1 / 4), "the router loss is missing from FlashREINFORCE's"
    assert result.metrics["aux_loss"] == [2.5]
    assert (
        make_objective(
            AsyncGRPOConfig(output_dir="unused", algorithm="flash_reinforce", num_generations=1), aux_loss_coef=0.01
        ).aux_loss_coef
        == 0.01
    )


def test_a_row_not_seen_by_begin_step_is_refused():
    objective = FlashReinforce(delta=1.0, negative_token_fraction=1.0)
    with pytest.raises(RuntimeError, match="not among the rows passed to begin_step"):
        objective.row_loss(two_sample_row(), scored([-0.5] * 5), LossShare.of([two_sample_row()], 1))


def random_step(seed: int) -> list:
    """Rows holding turns of several rollouts: some single-turn, some with 2-3 turns spread over the rows
    (a later turn extends the earlier conversation), shared prefixes and random trained masks."""
    rng = random.Random(seed)
    rows = [[] for _ in range(3)]
    for rollout in range(7):
        reward, conversation = float(rng.random() < 0.5), [rng.randrange(3, 300) for _ in range(rng.randrange(2, 6))]
        for _ in range(rng.randrange(1, 4)):
            prompt = len(conversation)
            conversation = conversation + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 7))]
            trained = [False] * prompt + [rng.random() < 0.8 for _ in range(len(conversation) - prompt)]
            trained[-1] = True
            logprobs = [-rng.uniform(0.05, 3.0) for _ in conversation]
            rows[rng.randrange(3)].append(
                turn(f"r{rollout}", conversation, trained, reward=reward, behavior_log_probs=logprobs)
            )
    return [pack(samples) for samples in rows if samples]


def reference_coefficients(rows, forwards, delta, fraction):
    """FlashREINFORCE's c_t, token by token: every trained token appended to its rollout's trajectory in
    row order, the reference loss's gradient read back the same way."""
    trajectories, terms = {}, []
    for r, row in enumerate(rows):
        for t, s in enumerate(row.term_sample.tolist()):
            terms.append((trajectories.setdefault(row.samples[s].rollout_id, len(trajectories)), r, t))
    rewards = torch.zeros(len(trajectories))
    for row in rows:
        for sample in row.samples:
            rewards[trajectories[sample.rollout_id]] = sample.reward
    width = max(sum(1 for i, _, _ in terms if i == j) for j in range(len(trajectories)))
    current, behavior, entropies = (torch.zeros(len(trajectories), width) for _ in range(3))
    mask, filled, places = torch.zeros(len(trajectories), width, dtype=torch.bool), [0] * len(trajectories), []
    for i, r, t in terms:
        j, filled[i] = filled[i], filled[i] + 1
        current[i, j], behavior[i, j] = forwards[r].log_probs[t].item(), rows[r].behavior_log_probs[t].item()
        entropies[i, j], mask[i, j] = forwards[r].entropy[t].item(), True
        places.append((i, j))
    current.requires_grad_(True)
    flash_reinforce_loss(
        current,
        behavior.clamp(max=0.0),
        rewards,
        mask,
        delta=delta,
        negative_token_fraction=fraction,
        entropies=entropies,
        failures=rewards <= 0,
    )[0].backward()
    coefficients = [torch.zeros(row.num_trained) for row in rows]
    for (i, j), (_, r, t) in zip(places, terms):
        coefficients[r][t] = current.grad[i, j]
    return coefficients


@pytest.mark.parametrize("seed", range(4))
def test_flash_reinforce_coefficients_equal_the_token_by_token_rearrangement(seed):
    rows = random_step(seed)
    generator = torch.Generator().manual_seed(seed)
    forwards = [
        TokenLogProbs(
            (row.behavior_log_probs + 0.3 * torch.randn(row.num_trained, generator=generator)).clamp(max=0.0),
            torch.rand(row.num_trained, generator=generator),
        )
        for row in rows
    ]
    delta, fraction = 0.02, 0.5  # some trajectories rejected; failed ones keep their highest-entropy half
    objective = FlashReinforce(delta, fraction)
    records = objective.begin_step(rows, lambda: forwards)
    assert 0.0 < records["flash/acceptance_rate"][0] < 1.0
    for row, forward, reference in zip(rows, forwards, reference_coefficients(rows, forwards, delta, fraction)):
        logprobs = forward.log_probs.clone().requires_grad_(True)
        objective.row_loss(row, TokenLogProbs(logprobs, forward.entropy), LossShare.of(rows, 1)).loss.backward()
        assert torch.equal(logprobs.grad, reference)
