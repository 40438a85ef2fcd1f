"""Each objective's gradient equals its formula (float64, 1e-10) on hand-built inputs."""

import math
from dataclasses import replace

import pytest
import torch

from tandem.losses import flash_reinforce_loss
from tandem.losses.grpo import clipped_surrogate
from tandem.losses.ratio import ImportanceSampling, off_policy_stats
from tandem.losses.score_centering import score_centered

F64 = torch.float64
RULE = ImportanceSampling(epsilon_low=0.2, epsilon_high=0.28, clip_min=0.5, clip_max=5.0)


def leaf(values):
    return torch.tensor(values, dtype=F64, requires_grad=True)


def test_clipped_surrogate_gradient_is_masked_and_clipped_ratio_times_advantage():
    old = torch.zeros(6, dtype=F64)
    # ratios: inside, exactly at C_min, exactly at C_max, below C_min, above the clip for A>0, below it for A<0
    ratios = [1.1, 0.5, 5.0, 0.4, 1.5, 0.7]
    logprobs = leaf([math.log(r) for r in ratios])
    advantages = torch.tensor([1.0, 1.0, -1.0, 1.0, 2.0, -1.0], dtype=F64)
    at_max = torch.exp(logprobs[2].detach()).item()  # exp(log 5) is 5 - 1 ulp: the bound is set to exactly that
    losses, stats = clipped_surrogate(logprobs, old, advantages, replace(RULE, clip_max=at_max))
    assert torch.exp(logprobs.detach())[1].item() == RULE.clip_min, "the C_min token sits exactly on the bound"
    losses.sum().backward()
    # d/dlogp of -min(rA, clip(r)A) = -rA where the unclipped term is the minimum, else 0; masked outside [C_min, C_max]
    expected = [-1.1 * 1, -0.5 * 1, -at_max * -1, 0.0, 0.0, 0.0]
    assert torch.allclose(logprobs.grad, torch.tensor(expected, dtype=F64), atol=1e-10, rtol=0)
    assert stats.in_bounds.tolist() == [True, True, True, False, True, True]


def test_clip_ratio_counts_every_token_outside_the_trust_region_whatever_its_advantage_sign():
    ratios = torch.tensor([1.1, 0.5, 5.0, 0.4, 1.5, 0.7], dtype=F64)
    for sign in (1.0, -1.0):  # the clip is active for one sign only; clip_ratio/* counts both
        _, stats = clipped_surrogate(ratios.log(), torch.zeros(6, dtype=F64), torch.full((6,), sign, dtype=F64), RULE)
        assert stats.above.tolist() == [False, False, True, False, True, False], "above 1 + epsilon_high = 1.28"
        assert stats.below.tolist() == [False, True, False, True, False, True], "below 1 - epsilon = 0.8"


def test_score_centering_gradient_matches_the_formula_through_a_softmax():
    """A categorical policy over 5 tokens (logits θ, temperature 0.7), the sampler's top-3 at each of two positions."""
    torch.manual_seed(0)
    theta = torch.randn(2, 5, dtype=F64, requires_grad=True)
    sampler = torch.randn(2, 5, dtype=F64).log_softmax(-1)
    temperature = 0.7
    policy = (theta / temperature).log_softmax(-1)
    sampled = torch.tensor([1, 3])
    top = sampler.topk(3, dim=-1).indices
    advantages = torch.tensor([1.5, -0.5], dtype=F64)
    losses, stats, mass = score_centered(
        policy.gather(1, sampled[:, None])[:, 0],
        sampler.gather(1, sampled[:, None])[:, 0],
        advantages,
        policy.gather(1, top),
        sampler.gather(1, top),
        RULE,
    )
    losses.sum().backward()

    def score(i, v):  # ∇_θ log π(v) at position i: (e_v - π) / T on row i
        grad = torch.zeros(2, 5, dtype=F64)
        grad[i] = -policy[i].detach().exp()
        grad[i, v] += 1
        return grad / temperature

    def f(r):
        return r if RULE.clip_min <= r <= RULE.clip_max else 0.0

    expected = torch.zeros(2, 5, dtype=F64)
    for i in range(2):
        mu, pi = sampler[i].exp(), policy[i].detach().exp()
        o = int(sampled[i])
        inner = sum(mu[v] * f(pi[v] / mu[v]) * score(i, int(v)) for v in top[i])
        expected += -advantages[i] * (f(pi[o] / mu[o]) * score(i, o) - inner)
    assert torch.allclose(theta.grad, expected, atol=1e-10, rtol=0)
    assert torch.allclose(mass, sampler.gather(1, top).exp().sum(-1), atol=1e-12)


def test_score_centering_masks_and_padding():
    """A top-K entry outside [C_min, C_max] and a padded entry (-inf) contribute nothing; the bound is inclusive."""
    logprobs, old = leaf([math.log(0.5)]), torch.zeros(1, dtype=F64)
    top = leaf([[math.log(0.5), math.log(0.9), 0.0]])
    top_sampler = torch.tensor([[0.0, math.log(0.1), float("-inf")]], dtype=F64)  # ratios 0.5 (in), 9 (out), pad
    losses, stats, mass = score_centered(logprobs, old, torch.ones(1, dtype=F64), top, top_sampler, RULE)
    losses.sum().backward()
    assert stats.in_bounds.tolist() == [True]
    assert logprobs.grad.tolist() == pytest.approx([-0.5], abs=1e-12)  # -A · m · r
    assert top.grad.tolist()[0] == pytest.approx([0.5, 0.0, 0.0], abs=1e-12)  # +A · m_v · π(v)
    assert mass.tolist() == pytest.approx([1.1])


def test_score_centering_removes_the_pull_toward_the_sampler():
    """Unbiasedness: with a constant advantage, the expected centered update under the sampler is zero, while the
    importance-weighted score alone is not (a token's ratio falls outside [C_min, C_max]). Monte Carlo over 40k
    draws, tolerance 5 standard errors."""
    generator = torch.Generator().manual_seed(1)
    vocab, draws = 6, 40_000
    theta = torch.tensor([0.5, -0.3, 1.2, 0.0, -1.5, 0.4], dtype=F64)
    sampler = torch.tensor([0.3, 0.1, 0.2, 0.15, 0.2, 0.05], dtype=F64).log()  # token 4: π/μ ≈ 0.09, masked
    tokens = torch.multinomial(sampler.exp(), draws, replacement=True, generator=generator)
    every = torch.arange(vocab).expand(draws, vocab)  # top-K = the whole vocabulary: the inner expectation is exact
    for centered in (True, False):
        # One gradient per draw: the Jacobian of the per-token losses with respect to the logits.
        grads = torch.autograd.functional.jacobian(
            lambda t, centered=centered: _losses(t, tokens, every, sampler, centered),
            theta,
            vectorize=True,
            strategy="forward-mode",
        )
        mean, stderr = grads.mean(0), grads.std(0) / math.sqrt(draws)
        if centered:
            assert (mean.abs() < 5 * stderr + 1e-12).all(), (
                f"centered update is biased: {mean.tolist()} ± {stderr.tolist()}"
            )
        else:
            assert (mean.abs() > 10 * stderr).any(), f"the uncentered update should be biased: {mean.tolist()}"


def _losses(theta, chunk, every, sampler, centered):
    policy = theta.log_softmax(-1)
    ones = torch.ones(chunk.numel(), dtype=F64)
    if centered:
        return score_centered(policy[chunk], sampler[chunk], ones, policy[every], sampler[every], RULE)[0]
    return clipped_surrogate(policy[chunk], sampler[chunk], ones, replace(RULE, epsilon_low=1e9, epsilon_high=1e9))[0]


# ---- off-policy corrections ----------------------------------------------------------------------
# Two samples: sample 0's tokens have ratios 1.2, 0.9, 3.0 (ρ = 3.24, g = 1.48), sample 1's 0.6, 1.1 (ρ = 0.66,
# g = 0.81); bounds [0.5, 1.4]. A trust region too wide to clip, so each token's gradient is -c_t·q_t·A.
CORRECTION_RATIOS = [1.2, 0.9, 3.0, 0.6, 1.1]
SEQUENCE = torch.tensor([0, 0, 0, 1, 1])
WIDE = replace(RULE, epsilon_low=1e9, epsilon_high=1e9, clip_max=1.4)
RHO0, RHO1 = 1.2 * 0.9 * 3.0, 0.6 * 1.1


@pytest.mark.parametrize(
    "mode, factors",
    [
        ("token_mask", [1, 1, 0, 1, 1]),
        ("token_truncate", [1, 1, 1.4 / 3.0, 1, 1]),
        ("sequence_mask", [0, 0, 0, 1, 1]),
        ("sequence_truncate", [1.4 / RHO0] * 3 + [1, 1]),
        ("geometric_mask", [0, 0, 0, 1, 1]),
    ],
)
def test_each_correction_scales_a_tokens_gradient_by_its_factor(mode, factors):
    logprobs = leaf([math.log(r) for r in CORRECTION_RATIOS])
    advantages = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0], dtype=F64)
    losses, stats = clipped_surrogate(
        logprobs, torch.zeros(5, dtype=F64), advantages, replace(WIDE, mode=mode), SEQUENCE
    )
    losses.sum().backward()
    factors = torch.tensor(factors, dtype=F64)
    assert torch.allclose(stats.weight, factors, atol=1e-12), f"{mode}: c_t {stats.weight.tolist()}"
    expected = -factors * torch.tensor(CORRECTION_RATIOS, dtype=F64) * advantages
    assert torch.allclose(logprobs.grad, expected, atol=1e-10, rtol=0)


def test_the_sequence_level_ratio_is_gspos_geometric_mean_with_its_gradient_over_the_sequence():
    logprobs = leaf([math.log(r) for r in CORRECTION_RATIOS])
    advantages = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0], dtype=F64)
    gspo = replace(WIDE, clip_min=0.0, clip_max=math.inf, level="sequence")
    losses, _ = clipped_surrogate(logprobs, torch.zeros(5, dtype=F64), advantages, gspo, SEQUENCE)
    losses.sum().backward()
    # L = -Σ_s |s|·g_s·A_s, and ∂g_s/∂log π_t = g_s/|s| for t in s: each token's gradient is -g_s·A_s.
    g = [RHO0 ** (1 / 3)] * 3 + [RHO1**0.5] * 2
    assert torch.allclose(logprobs.grad, -torch.tensor(g, dtype=F64) * advantages, atol=1e-10, rtol=0)
    # With GSPO's narrow trust region sample 0 (g = 1.48 > 1 + 4e-4, A > 0) is clipped: no gradient.
    logprobs.grad = None
    narrow = replace(gspo, epsilon_low=3e-4, epsilon_high=4e-4)
    losses, stats = clipped_surrogate(logprobs, torch.zeros(5, dtype=F64), advantages, narrow, SEQUENCE)
    losses.sum().backward()
    assert logprobs.grad[:3].tolist() == [0.0, 0.0, 0.0] and stats.above.tolist() == [True] * 3 + [False] * 2


def test_score_centering_judges_each_alternative_by_a_token_correction():
    """token_truncate: the sampled token (ratio 0.5) keeps c = 1; the alternative of ratio 9 is weighted 5/9."""
    logprobs, old = leaf([math.log(0.5)]), torch.zeros(1, dtype=F64)
    top = leaf([[math.log(0.5), math.log(0.9), 0.0]])
    top_sampler = torch.tensor([[0.0, math.log(0.1), float("-inf")]], dtype=F64)
    losses, _, _ = score_centered(
        logprobs, old, torch.ones(1, dtype=F64), top, top_sampler, replace(RULE, mode="token_truncate")
    )
    losses.sum().backward()
    assert logprobs.grad.tolist() == pytest.approx([-0.5], abs=1e-12)
    assert top.grad.tolist()[0] == pytest.approx([0.5, 5 / 9 * 0.9, 0.0], abs=1e-12)


def test_off_policy_statistics_are_their_formulas_and_exact_on_policy():
    ratios = torch.tensor(CORRECTION_RATIOS, dtype=F64)
    _, stats = clipped_surrogate(ratios.log(), torch.zeros(5, dtype=F64), torch.ones(5, dtype=F64), WIDE, SEQUENCE)
    recorded = off_policy_stats(stats)
    ((total, squares, count),) = recorded["sampling/effective_sample_size"]
    assert total**2 / (count * squares) == pytest.approx(float(ratios.sum() ** 2 / (5 * (ratios**2).sum())), abs=1e-12)
    assert recorded["sampling/mismatch_kl"] == pytest.approx((ratios - 1 - ratios.log()).tolist(), abs=1e-12)
    assert recorded["sampling/masked_tokens_frac"] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert recorded["sampling/masked_sequences_frac"] == [0.0, 0.0], "token_mask leaves part of each sample"
    _, stats = clipped_surrogate(
        ratios.log(), torch.zeros(5, dtype=F64), torch.ones(5, dtype=F64), replace(WIDE, mode="sequence_mask"), SEQUENCE
    )
    assert off_policy_stats(stats)["sampling/masked_sequences_frac"] == [1.0, 0.0]
    on_policy = torch.full((5,), -0.7, dtype=torch.float32)
    _, stats = clipped_surrogate(on_policy, on_policy, torch.ones(5), RULE, SEQUENCE)
    recorded = off_policy_stats(stats)
    ((total, squares, count),) = recorded["sampling/effective_sample_size"]
    assert total**2 / (count * squares) == 1.0 and set(recorded["sampling/mismatch_kl"]) == {0.0}


# ---- FlashREINFORCE ------------------------------------------------------------------------------
def batch(lengths, rewards, gap=0.0):
    """Rows of the given lengths (padded to the longest); the behaviour log-probs sit `gap` below the policy's."""
    width = max(lengths)
    mask = torch.tensor([[j < n for j in range(width)] for n in lengths])
    torch.manual_seed(2)
    current = leaf((-torch.rand(len(lengths), width, dtype=F64) - 0.1).tolist())
    behavior = current.detach() - gap
    return current, behavior, torch.tensor(rewards, dtype=F64), mask


def test_flash_reinforce_gradient_is_the_gated_sample_mean():
    current, behavior, rewards, mask = batch([1, 9, 4], [1.0, 0.0, 0.5], gap=0.01)
    loss, diag = flash_reinforce_loss(current, behavior, rewards, mask, delta=float("inf"))
    loss.backward()
    advantages = rewards - rewards.mean()
    ratio = torch.exp(current.detach() - behavior)
    expected = -(advantages[:, None] * ratio / mask.sum(-1, keepdim=True)) / 3 * mask
    assert torch.allclose(current.grad, expected, atol=1e-10, rtol=0)
    assert diag["acceptance_rate"].item() == 1.0
    assert behavior.grad is None and not any(v.requires_grad for v in diag.values())


def test_a_trajectory_of_one_token_and_one_of_nine_carry_the_same_total_weight():
    current, behavior, rewards, mask = batch([1, 9], [1.0, -1.0])  # on-policy: ratio 1
    flash_reinforce_loss(current, behavior, rewards, mask, delta=float("inf"))[0].backward()
    totals = current.grad.sum(-1).abs()
    assert torch.allclose(totals[0], totals[1], atol=1e-12)


def test_the_gate_admits_a_statistic_equal_to_delta_and_rejects_above():
    current, behavior, rewards, mask = batch([3, 3], [1.0, 0.0], gap=0.05)
    _, diag = flash_reinforce_loss(current, behavior, rewards, mask, delta=float("inf"))
    statistic = diag["sequence_kl"]
    _, at = flash_reinforce_loss(current, behavior, rewards, mask, delta=statistic.max().item())
    assert at["admitted"].all(), "δ equal to the statistic admits (inclusive)"
    _, below = flash_reinforce_loss(current, behavior, rewards, mask, delta=statistic.min().item() * 0.999)
    assert not below["admitted"].any()


def test_an_all_rejected_batch_and_equal_rewards_give_zero_gradient():
    current, behavior, rewards, mask = batch([3, 5], [1.0, 0.0], gap=0.5)
    loss, diag = flash_reinforce_loss(current, behavior, rewards, mask, delta=1e-6)
    loss.backward()
    assert diag["acceptance_rate"].item() == 0.0 and (current.grad == 0).all()
    current, behavior, _, mask = batch([3, 5], [0.0, 0.0])
    flash_reinforce_loss(current, behavior, torch.tensor([0.7, 0.7], dtype=F64), mask)[0].backward()
    assert (current.grad == 0).all()


def test_entropy_filtering_keeps_the_highest_entropy_tokens_of_failed_rows():
    current, behavior, rewards, mask = batch([5, 5], [0.0, 1.0])
    entropies = torch.tensor([[0.1, 0.9, 0.5, 0.9, 0.2], [0.3, 0.3, 0.3, 0.3, 0.3]], dtype=F64)
    failures = torch.tensor([True, False])
    loss, diag = flash_reinforce_loss(
        current,
        behavior,
        rewards,
        mask,
        delta=float("inf"),
        negative_token_fraction=0.5,
        entropies=entropies,
        failures=failures,
    )
    loss.backward()
    assert diag["retained_tokens"].tolist() == [3, 5]  # ceil(0.5 · 5) = 3 in the failed row
    assert (current.grad[0] != 0).tolist() == [False, True, True, True, False]  # 0.9, 0.9 (earlier first), 0.5
    assert diag["policy_tokens"].tolist() == [5, 5]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(log_probs=torch.zeros(0, 0)), "non-empty"),
        (lambda a: a.update(rewards=torch.zeros(3)), "rewards must have shape"),
        (lambda a: a.update(action_mask=torch.ones(2, 3)), "must be bool"),
        (lambda a: a.update(action_mask=torch.tensor([[True, True, True], [False, False, False]])), "no policy token"),
        (lambda a: a.update(log_probs=torch.tensor([[-0.1, float("nan"), -0.2], [-0.1, -0.1, -0.1]])), "NaN"),
        (lambda a: a.update(behavior_log_probs=torch.tensor([[-0.1, 0.3, -0.2], [-0.1, -0.1, -0.1]])), "positive"),
        (lambda a: a.update(delta=-1.0), "delta=-1.0"),
        (lambda a: a.update(negative_token_fraction=1.5), "negative_token_fraction=1.5"),
        (lambda a: a.update(negative_token_fraction=0.5), "pass entropies"),
    ],
)
def test_invalid_inputs_are_named(change, message):
    arguments = {
        "log_probs": torch.full((2, 3), -0.5),
        "behavior_log_probs": torch.full((2, 3), -0.5),
        "rewards": torch.tensor([1.0, 0.0]),
        "action_mask": torch.ones(2, 3, dtype=torch.bool),
        "delta": 3e-3,
        "negative_token_fraction": 1.0,
    }
    change(arguments)
    with pytest.raises(ValueError, match=message):
        flash_reinforce_loss(**arguments)


def test_values_outside_the_mask_are_ignored_and_half_precision_is_promoted():
    log_probs = torch.tensor([[-0.5, float("nan")], [-0.2, -0.3]], dtype=torch.bfloat16, requires_grad=True)
    mask = torch.tensor([[True, False], [True, True]])
    loss, _ = flash_reinforce_loss(log_probs, log_probs.detach(), torch.tensor([1.0, 0.0]), mask)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
