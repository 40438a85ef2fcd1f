"""The run's console: a live dashboard in a terminal, plain lines elsewhere (a pipe, a log file, CI) never cut, and
the doctor's one-line warnings when a finding changes."""

import io

from rich.console import Console

from tandem.metrics.console import RunConsole


def test_outside_a_terminal_each_window_is_one_whole_plain_line_even_on_a_narrow_console():
    out = io.StringIO()
    line = RunConsole(300, console=Console(file=out, width=20, force_terminal=False))
    line.update(10, {"reward": 0.4123, "perf/step_s": 0.83, "rollout/queue_size": 24.0, "sample/staleness_mean": 0.4})
    line.update(20, {"reward": 0.5})
    line.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("train step 10/300  reward 0.412  step 0.83s  queue 24  stale 0.4  elapsed 0:00:")
    assert "  eta " in lines[0] and "…" not in out.getvalue(), "nothing is cut to the console's 20 columns"
    assert lines[1].startswith("train step 20/300  reward 0.500  elapsed")


def test_in_a_terminal_a_live_dashboard_shows_its_metric_pairs_and_no_plain_lines():
    out = io.StringIO()
    console = RunConsole(None, console=Console(file=out, width=120, force_terminal=True))
    for step, reward in enumerate([0.1, 0.3, 0.25], start=1):
        console.update(
            step,
            {
                "reward": reward,
                "perf/step_s": 0.5,
                "perf/fwd_bwd_s": 0.3,
                "perf/fwd_s": 0.1,
                "rollout/queue_size": 40,
                "rollout/backpressure_s": 0.02,
            },
        )
    console.live.refresh()
    console.close()
    shown = out.getvalue()
    for label in (
        "reward",
        "step / forward+backward",
        "rollout wait",
        "queue / samples per step",
        "backpressure / score block",
        "step split",
        "in flight / cap",
    ):
        assert label in shown, f"the dashboard lacks {label!r}"
    assert "0.250  ▁█▇" in shown, "the reward's sparkline runs from its lowest to its highest value"
    assert "reward 0.250  step" not in shown, "no plain line in a terminal"


def test_a_reward_of_inf_or_nan_does_not_break_the_dashboard():
    out = io.StringIO()
    console = RunConsole(10, console=Console(file=out, width=120, force_terminal=True))
    for step, reward in enumerate([0.1, float("inf"), float("nan"), 0.3], start=1):
        console.update(step, {"reward": reward})
    console.live.refresh()
    console.close()
    assert "0.300  ▁█" in out.getvalue()


def test_a_changed_finding_is_one_doctor_line_once_it_held_a_few_windows():
    out = io.StringIO()
    console = RunConsole(100, config={"num_generations": 8}, console=Console(file=out, width=300, force_terminal=False))
    common = {"perf/step_s": 1.0, "batch/samples_per_step": 32, "reward": 0.5, "frac_reward_zero_std": 0.1}
    trainer_bound = {**common, "rollout/queue_size": 150, "rollout/backpressure_s": 0.6, "perf/rollout_wait_s": 0.0}
    generation_bound = {**common, "rollout/queue_size": 0, "rollout/backpressure_s": 0.0, "perf/rollout_wait_s": 0.7}
    for step in range(1, 81):
        console.update(step, trainer_bound if step <= 40 else generation_bound)
    warnings = [line for line in out.getvalue().splitlines() if line.startswith("doctor:")]
    assert [w.split(" (")[0] for w in warnings] == [
        "doctor: bottleneck: trainer-bound",
        "doctor: bottleneck: generation-bound",
    ]
    assert "raise max_concurrent_rollouts" in warnings[1], "the warning carries the knob"


def test_the_eta_of_a_resumed_run_counts_from_where_it_resumed():
    out = io.StringIO()
    line = RunConsole(500, console=Console(file=out, width=200, force_terminal=False))
    line.started -= 10.0  # ten seconds in, at the first step after resuming from 400
    line.update(401, {})
    assert "eta 0:16:3" in out.getvalue(), out.getvalue()  # 99 steps left at 10 s each, not 99 at 10/401 s


def test_num_completions_to_print_limits_the_table_and_zero_prints_none():
    examples = [([{"role": "user", "content": f"{i} + 1?"}], f"{i + 1}", 1.0) for i in range(3)]
    for limit, rows in ((None, 3), (2, 2), (0, 0)):
        out = io.StringIO()
        RunConsole(3, console=Console(file=out, width=80, force_terminal=False)).print_completions(examples, limit)
        assert sum(f"{i} + 1?" in out.getvalue() for i in range(3)) == rows, f"limit {limit}: {out.getvalue()}"
        assert ("completions" in out.getvalue()) == bool(rows), "no empty table"
