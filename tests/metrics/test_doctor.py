"""`tandem doctor` on synthetic runs, one per row of the symptom tables in TRL's AsyncGRPOTrainer documentation."""

import json

import pytest

from tandem.cli import main
from tandem.metrics.doctor import diagnose, read_run

CONFIG = {
    "max_staleness": 4,
    "max_concurrent_rollouts": 64,
    "num_generations": 8,
    "weight_sync_steps": 1,
    "vllm_importance_sampling_clip_min": 0.5,
    "vllm_importance_sampling_clip_max": 5.0,
}
BALANCED = {
    "perf/step_s": 1.0,
    "perf/rollout_wait_s": 0.05,
    "rollout/backpressure_s": 0.05,
    "rollout/queue_size": 40,
    "batch/samples_per_step": 32,
    "rollout/concurrency": 20,
    "rollout/concurrency_cap": 64,
    "rollout/vllm_kv_cache_usage_frac": 0.3,
    "reward": 0.4,
    "frac_reward_zero_std": 0.2,
    "reward_dropped": 0.3,
    "completions/duplicate_frac": 0.05,
    "completions/clipped_ratio": 0.02,
    "entropy": 0.8,
    "sampling/importance_sampling_ratio/mean": 1.0,
    "perf/weight_sync_s": 0.05,
}


def run(*phases: dict, windows: int = 15) -> list[dict]:
    """A run of `windows` logged lines per phase, each line the balanced one with the phase's changes."""
    lines = [{**BALANCED, **phase} for phase in phases for _ in range(windows)]
    return [{**line, "step": step} for step, line in enumerate(lines, start=1)]


def verdicts(rows, area: str, label: str = "whole run", config: dict | None = None) -> list[str]:
    return [f.verdict for f in diagnose(rows, CONFIG | (config or {}))[label] if f.area == area]


@pytest.mark.parametrize(
    "changes, verdict",
    [
        ({}, "balanced"),
        ({"rollout/queue_size": 0, "perf/rollout_wait_s": 0.6}, "generation-bound"),
        ({"rollout/queue_size": 150, "rollout/backpressure_s": 0.5}, "trainer-bound"),
        ({"perf/rollout_wait_s": 0.5, "rollout/backpressure_s": 0.5}, "staleness bound too tight"),
        (
            {"perf/rollout_wait_s": 0.6, "rollout/concurrency": 64, "rollout/vllm_kv_cache_usage_frac": 0.2},
            "concurrency cap bound",
        ),
        (
            {"perf/rollout_wait_s": 0.6, "rollout/concurrency_cap": 30, "rollout/vllm_kv_cache_usage_frac": 0.9},
            "server saturated",
        ),
        (
            {"perf/rollout_wait_s": 0.6, "rollout/concurrency_cap": 30},
            "generation-bound",
        ),  # a cap still climbing, KV free
        # tandem holds generation back before a group starts: a full token allowance is the held-back side's evidence
        ({"perf/rollout_wait_s": 0.5, "rollout/allowance_used_max": 0.99}, "staleness bound too tight"),
        ({"perf/rollout_wait_s": 0.1, "rollout/allowance_used_max": 0.99}, "trainer-bound"),  # short stalls, queue full
        ({"perf/rollout_wait_s": 0.1, "rollout/allowance_used_max": 0.6}, "balanced"),
        (
            {"perf/rollout_wait_s": 0.6, "rollout/vllm_running_requests": 40, "rollout/vllm_queued_requests": 20},
            "server saturated",
        ),
        (
            {"perf/rollout_wait_s": 0.6, "rollout/vllm_running_requests": 40, "rollout/vllm_queued_requests": 4},
            "generation-bound",
        ),
    ],
)
def test_the_bottleneck_is_named_from_queue_waits_and_caps(changes, verdict):
    assert verdicts(run(changes), "bottleneck") == [verdict]


def test_one_poll_that_caught_a_burst_of_waiting_requests_is_no_saturated_server():
    starved = {"perf/rollout_wait_s": 0.6, "rollout/vllm_running_requests": 80}
    burst = run(
        {**starved, "rollout/vllm_queued_requests": 0}, {**starved, "rollout/vllm_queued_requests": 48}, windows=3
    )
    assert verdicts(burst, "bottleneck") == ["generation-bound"], (
        "waiting in half the polls: requests between two steps"
    )
    backlog = run(
        {**starved, "rollout/vllm_queued_requests": 0}, {**starved, "rollout/vllm_queued_requests": 48}, windows=3
    )
    backlog[0]["rollout/vllm_queued_requests"] = 48
    assert verdicts(backlog, "bottleneck") == ["server saturated"], "waiting in most polls: the server is at capacity"
    assert verdicts(run({**starved, "rollout/vllm_queued_requests": 48}, windows=1), "bottleneck") == [
        "generation-bound"
    ], "a single poll says nothing either way"


@pytest.mark.parametrize(
    "phases, verdict, critical",
    [
        (({}, {}), "healthy", False),
        (
            ({"reward": 0.6}, {"reward": 0.95, "frac_reward_zero_std": 0.8, "reward_dropped": 0.97}),
            "saturated at the top",
            False,
        ),
        (
            ({"reward": 0.02}, {"reward": 0.02, "frac_reward_zero_std": 0.95, "reward_dropped": 0.0}),
            "stuck at the bottom",
            False,
        ),
        (({"reward": 0.6}, {"reward": 0.3, "frac_reward_zero_std": 0.4}), "regression", True),
        (
            ({"reward": 0.5, "entropy": 0.8}, {"reward": 0.45, "entropy": 0.1, "completions/duplicate_frac": 0.8}),
            "collapse",
            True,
        ),
    ],
)
def test_learning_health_reads_zero_std_groups_dropped_reward_duplicates_and_entropy(phases, verdict, critical):
    findings = [f for f in diagnose(run(*phases), CONFIG)["whole run"] if f.area == "learning"]
    assert [(f.verdict, f.critical) for f in findings] == [(verdict, critical)]


def test_a_stuck_run_with_truncated_completions_is_told_to_raise_the_length():
    rows = run({"reward": 0.0, "frac_reward_zero_std": 0.95, "reward_dropped": 0.0, "completions/clipped_ratio": 0.7})
    (finding,) = [f for f in diagnose(rows, CONFIG)["whole run"] if f.area == "learning"]
    assert finding.knob == "raise max_completion_length"


def test_a_converged_run_with_identical_correct_answers_is_saturated_not_collapsed():
    rows = run(
        {"reward": 0.5, "entropy": 0.4},
        {
            "reward": 0.92,
            "entropy": 0.08,
            "completions/duplicate_frac": 0.85,
            "frac_reward_zero_std": 0.85,
            "reward_dropped": 0.93,
        },
    )
    assert verdicts(rows, "learning") == ["saturated at the top"]


def test_sync_health_and_the_critical_ones():
    assert verdicts(run({}), "sync") == ["healthy"]
    assert verdicts(run({"sampling/importance_sampling_ratio/mean": 1.2}), "sync") == ["importance ratio drifts"]
    assert verdicts(run({"sampling/importance_sampling_ratio/mean": 6.0}), "sync") == ["importance ratio out of bounds"]
    assert verdicts(run({"sample/dropped_stale_count": 40}), "sync") == ["most samples dropped stale"]
    assert verdicts(run({"perf/weight_sync_s": 0.6}), "sync") == ["syncs take a large share of each step"]
    assert verdicts(run({"perf/weight_sync_s": 0.6, "perf/weight_sync_wait_s": 0.01}), "sync") == ["healthy"], (
        "a sync beside the next step costs the step only what the trainer waited for it"
    )
    quiet_end = run({}) + [{"step": 99, "reward": 0.4, "frac_reward_zero_std": 1.0}] * 5
    assert "no trainable sample" in verdicts(quiet_end, "run", "last window")


def test_a_falling_effective_sample_size_or_a_growing_mismatch_names_a_correction_to_try():
    on_policy = {"sampling/effective_sample_size": 1.0, "sampling/mismatch_kl": 0.0}
    assert verdicts(run(on_policy), "sync") == ["healthy"]
    falling = run(on_policy, {"sampling/effective_sample_size": 0.93})
    assert verdicts(falling, "sync") == ["effective sample size falls"]
    low = diagnose(run({"sampling/effective_sample_size": 0.8}), CONFIG)["last window"]
    assert [f.verdict for f in low if f.area == "sync"] == ["effective sample size low"]
    assert "vllm_importance_sampling_mode geometric_mask" in low[-1].knob
    growing = run({"sampling/mismatch_kl": 1e-3}, {"sampling/mismatch_kl": 8e-3})
    assert verdicts(growing, "sync") == ["mismatch grows"]
    assert verdicts(run({"sampling/mismatch_kl": 5e-4}, {"sampling/mismatch_kl": 9e-4}), "sync") == ["healthy"], (
        "under 1e-3 nats the mismatch is rounding"
    )
    told = diagnose(growing, CONFIG | {"vllm_importance_sampling_mode": "geometric_mask"})["whole run"]
    assert "token_truncate (now geometric_mask)" in [f for f in told if f.area == "sync"][0].knob
    flash = diagnose(growing, CONFIG | {"algorithm": "flash_reinforce", "flash_delta": 0.003})["whole run"]
    knob = [f for f in flash if f.area == "sync"][0].knob
    assert "lower flash_delta (now 0.003)" in knob and "vllm_importance_sampling_mode" not in knob, (
        "FlashREINFORCE refuses GRPO's corrections: the doctor must not suggest them"
    )
    first_seen = run({}, {"sampling/mismatch_kl": 8e-3})  # logged from the run's second half on only
    assert verdicts(first_seen, "sync") == ["healthy"], "a mismatch with nothing before it to compare has not grown"


def test_a_log_prob_gap_beyond_rounding_at_staleness_zero_is_critical():
    drifted = {"sample/staleness_max": 0, "sampling/sampling_logp_difference/mean": 0.04}
    fp32 = {"compute_dtype": "float32"}
    assert verdicts(run(drifted), "sync", config=fp32) == ["off-policy at staleness 0"]
    assert verdicts(run(drifted | {"sampling/sampling_logp_difference/mean": 7e-6}), "sync", config=fp32) == ["healthy"]
    assert verdicts(run(drifted | {"sample/staleness_max": 2}), "sync", config=fp32) == ["healthy"], (
        "stale samples differ by their staleness, not by a wrong server"
    )
    assert verdicts(run(drifted), "sync", config={"compute_dtype": "bfloat16"}) == ["healthy"], (
        "bf16 rounding reaches 0.06"
    )
    assert verdicts(run(drifted), "sync", config=fp32 | {"server_dtype": "bfloat16"}) == ["healthy"], (
        "the coarser of the trainer's and the server's dtype"
    )


def test_tandem_doctor_prints_the_findings_and_exits_1_on_a_critical_one(tmp_path, capsys):
    (tmp_path / "run_config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in run({})))
    main(["doctor", str(tmp_path)])
    out = capsys.readouterr().out
    assert "last window:" in out and "whole run:" in out and "bottleneck: balanced" in out
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in run({}, {"reward": 0.05})))
    with pytest.raises(SystemExit) as stop:
        main(["doctor", str(tmp_path)])
    assert stop.value.code == 1 and "CRITICAL learning: regression" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:  # a wrong path is the user's mistake, 2, not a finding
        main(["doctor", str(tmp_path / "elsewhere")])
    assert (
        stop.value.code == 2 and "has no metrics.jsonl: give the output_dir of a tandem run" in capsys.readouterr().err
    )


def test_a_broken_line_is_named_and_an_evaluations_line_joins_its_step(tmp_path, capsys):
    (tmp_path / "run_config.json").write_text(json.dumps(CONFIG))
    rows = run({})
    lines = [json.dumps(r) for r in rows] + [json.dumps({"step": rows[-1]["step"], "eval/reward": 0.5})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    read, _ = read_run(tmp_path)
    assert read[-1]["eval/reward"] == 0.5 and read[-1]["reward"] == rows[-1]["reward"], "the step's two lines merge"
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:3] + ["{broken"] + lines[3:]))
    with pytest.raises(SystemExit) as stop:
        main(["doctor", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "metrics.jsonl: line 4 is not JSON" in err, err


def test_partial_runs_windows_without_reward_and_coarse_logging_are_read_as_they_are(tmp_path, capsys):
    rows = [{"step": 1, "perf/step_s": 1.0}] + run({})  # a first window that scored nothing yet
    assert verdicts(rows, "learning") == ["healthy"]
    every_tenth = [{**BALANCED, "step": 10 * (i + 1), "sample/dropped_stale_count": 30} for i in range(15)]
    assert verdicts(every_tenth, "sync") == ["some samples dropped stale"], "30 of ~320 samples per window, not most"
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in run({})) + '\n{"step": 31, "rew')
    main(["doctor", str(tmp_path)])  # a line still being written is left out
    assert "(15 logged windows)" in capsys.readouterr().out
