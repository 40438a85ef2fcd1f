"""`tandem doctor` on the five runs of the HF Jobs LoRA async-GRPO blog post (its section on the bottleneck going back and forth, "ping-pong around the bottleneck"):
the figures the post publishes for each run, under tandem's metric names, must lead to the conclusion the post
reached by reading its dashboard.

Every figure cites its line in the post's text (in Japanese; quoted here in English). The post's names map to tandem's as:
sample/rollout_queue_size -> rollout/queue_size, rollout/inflight -> rollout/concurrency,
max_inflight_tasks -> max_concurrent_rollouts, perf/mfu_fwd_bwd -> perf/fwd_bwd_mfu.
"""

import pytest

from tandem.metrics.doctor import diagnose

RECIPE = {  # the same recipe in every run unless a run says otherwise
    "max_staleness": 4,  # line 242: "the limit is 4"
    "weight_sync_steps": 4,  # line 293: "once every 4 steps" a weight sync
    "max_concurrent_rollouts": 128,  # line 303: rollout/inflight is 128 in every run, the cap max_inflight_tasks
    "num_generations": 8,  # line 205: 8 rollouts per prompt
    "gradient_checkpointing": True,  # line 287: AsyncGRPOConfig's default
}

RUN_1 = (
    "r1-dp2",
    RECIPE,
    {
        "perf/step_s": 22.9,
        "perf/fwd_bwd_s": 21.9,  # line 230-231 (p50), line 269
        "perf/rollout_wait_s": 0.02,  # line 232
        "rollout/queue_size": 476,  # line 233: 476 of 512
        "rollout/backpressure_s": 15.0,  # line 269: "15 s per group blocked on backpressure"
        "batch/microbatches_per_step": 64,
        "batch/samples_per_row": 1.0,  # line 271
        "perf/fwd_bwd_mfu": 0.039,  # line 234
        "batch/samples_per_step": 128,  # line 324
        "perf/weight_sync_s": 8.5,  # line 326
        "sample/staleness_mean": 1.5,  # line 327
        "sampling/importance_sampling_ratio/mean": 1.0,  # line 240: between 0.9993 and 1.0004 throughout
    },
    (0.145, 0.438),
)  # line 242, line 328: reward, first 20 steps -> last 20 steps

RUN_2 = (
    "r1-dp2-tb16k",
    {**RECIPE, "token_budget": 16384, "gradient_accumulation_steps": 6},
    {  # line 275
        "batch/samples_per_row": 12.7,
        "batch/microbatches_per_step": 6,  # line 279
        "perf/step_s": 5.9,  # line 277: "the step time went from 23 s to 5.9 s"
        "perf/fwd_bwd_s": 5.6,
        "perf/fwd_s": 1.34,  # line 279, line 285
        "batch/samples_per_step": 150,  # line 279: "about 150 samples per step"
        "rollout/queue_size": 420,
        "perf/rollout_wait_s": 0.02,  # line 289: queue ~420, rollout wait 0.02 s before nockpt
    },
    None,
)

RUN_3 = (
    "r1-dp2-tb16k-nockpt",
    {**RUN_2[1], "gradient_checkpointing": False},
    {  # line 291
        "perf/fwd_bwd_s": 4.6,
        "perf/fwd_s": 4.6 / 3.5,  # line 291; line 293: backward still 2.5x the forward
        "rollout/queue_size": 71,
        "perf/rollout_wait_s": 0.6,  # line 291
        "perf/weight_sync_s": 7.6,  # line 293: 7.6 s every 4 steps ...
        "perf/step_s": 7.6 / 4 / 0.25,  # ... is 25% of the wall clock (line 293): a step of 7.6 s
        "batch/samples_per_step": 150,
        "batch/samples_per_row": 12.7,
        "batch/microbatches_per_step": 6,  # as run 2
        "rollout/concurrency": 128,  # line 299: "in both runs rollout/inflight is 128" -- runs 3 and 4
    },
    None,
)

RUN_4 = (
    "r1-dp3-tb16k-nockpt",
    RUN_3[1],
    {  # line 297: a third replica, nothing else in the trainer's recipe
        **RUN_3[
            2
        ],  # line 299: "generation and forward+backward unchanged" -- generation and forward+backward as in run 3
        "perf/weight_sync_s": 5.8,  # line 301
        "perf/step_s": 7.6 - (7.6 - 5.8) / 4,  # run 3's step less the sync time saved per step
    },
    None,
)

RUN_5 = (
    "r1-dp3-inflight384",
    {**RUN_4[1], "max_concurrent_rollouts": 384},
    {  # line 309
        "rollout/queue_size": 690,
        "rollout/backpressure_s": 5.0,
        "perf/rollout_wait_s": 0.03,  # line 313
        "perf/fwd_bwd_s": 4.6,
        "perf/step_s": 4.8,  # line 313, line 321-322
        "perf/fwd_bwd_mfu": 0.235,  # line 323
        "batch/samples_per_step": 168,  # line 324
        "perf/weight_sync_s": 6.2,  # line 326
        "sample/staleness_mean": 2.0,  # line 315, line 327
        "rollout/concurrency": 384,  # line 313: 384 requests in flight
        "sampling/importance_sampling_ratio/mean": 1.0,  # line 315: "the ratio is still very close to 1.000"
        "batch/samples_per_row": 12.7,
        "batch/microbatches_per_step": 6,
        "perf/fwd_s": 4.6 / 3.5,  # as runs 3-4
    },
    (0.145, 0.416),
)  # line 328


def logged(metrics: dict, reward: tuple[float, float] | None, steps: int = 100) -> list[dict]:
    """`steps` logged lines of the published figures, the reward (when published) rising linearly between the
    first and last values."""
    rows = [{**metrics, "step": step} for step in range(1, steps + 1)]
    if reward is not None:
        for i, row in enumerate(rows):
            row["reward"] = reward[0] + (reward[1] - reward[0]) * i / (steps - 1)
    return rows


def findings(run) -> dict[str, tuple[str, str]]:
    """The whole run's verdict and knob by area (sync: the first one)."""
    _, config, metrics, reward = run
    result = {}
    for finding in diagnose(logged(metrics, reward), config)["whole run"]:
        result.setdefault(finding.area, (finding.verdict, finding.knob))
    return result


def test_run_1_is_trainer_bound_with_one_sample_per_micro_batch_so_pack_them():
    result = findings(RUN_1)
    assert result["bottleneck"][0] == "trainer-bound"  # line 267: "it is trainer-bound"
    assert result["trainer"] == ("one sample per micro-batch", result["trainer"][1])  # line 271-275
    assert "token_budget" in result["trainer"][1]
    assert result["learning"][0] == "healthy" and result["sync"][0] == "healthy"  # line 240-244


def test_run_2_is_still_trainer_bound_and_the_forward_backward_split_points_at_gradient_checkpointing():
    result = findings(RUN_2)
    assert result["bottleneck"][0] == "trainer-bound"
    assert result["trainer"][0] == "backward recomputes the forward"  # line 285-287: 3.2x, gradient_checkpointing
    assert "gradient_checkpointing=False" in result["trainer"][1]


def test_run_3_moved_the_bottleneck_to_generation_and_exposed_the_sync():
    result = findings(RUN_3)
    # line 291: "the bottleneck moved to the generation side". The post added a replica next and found the in-flight cap only in run 4
    # (line 303); the doctor reads the same rollout/inflight of 128 in run 3 and names the cap one run earlier.
    assert result["bottleneck"][0] == "concurrency cap bound"
    assert result["trainer"][0] != "backward recomputes the forward"  # checkpointing is off
    verdicts = [f.verdict for f in diagnose(logged(RUN_3[2], None), RUN_3[1])["whole run"] if f.area == "sync"]
    assert "syncs take a large share of each step" in verdicts  # line 293: 25% of the wall clock


def test_run_4_is_bound_by_the_concurrency_cap_not_the_replicas():
    result = findings(RUN_4)
    assert result["bottleneck"][0] == "concurrency cap bound"  # line 303-305: the client's constant, not vLLM
    assert "max_concurrent_rollouts" in result["bottleneck"][1]


def test_run_5_is_trainer_bound_again_with_the_sampler_in_step():
    result = findings(RUN_5)
    assert result["bottleneck"][0] == "trainer-bound"  # line 313: "training became the bottleneck again"
    assert result["learning"][0] == "healthy"  # line 328: reward 0.145 -> 0.416
    assert "importance ratio" not in result["sync"][0]  # line 315


@pytest.mark.parametrize("run", [RUN_1, RUN_2, RUN_3, RUN_4, RUN_5], ids=lambda run: run[0])
def test_no_published_run_is_critical(run):
    _, config, metrics, reward = run
    assert not [f.line() for fs in diagnose(logged(metrics, reward), config).values() for f in fs if f.critical]
