"""The progress line: live in a terminal, plain lines elsewhere (a pipe, a log file, CI), never cut."""

import io

from rich.console import Console

from tandem.metrics.sinks import ProgressLine


def test_outside_a_terminal_each_window_is_one_whole_plain_line_even_on_a_narrow_console():
    out = io.StringIO()
    line = ProgressLine(300, console=Console(file=out, width=20, force_terminal=False))
    line.update(10, {"reward": 0.4123, "perf/step_s": 0.83, "rollout/queue_size": 24.0, "sample/staleness_mean": 0.4})
    line.update(20, {"reward": 0.5})
    line.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("train step 10/300  reward 0.412  step 0.83s  queue 24  stale 0.4  elapsed 0:00:")
    assert "  eta " in lines[0] and "…" not in out.getvalue(), "nothing is cut to the console's 20 columns"
    assert lines[1].startswith("train step 20/300  reward 0.500  elapsed")


def test_in_a_terminal_the_line_is_live_and_prints_no_plain_lines():
    out = io.StringIO()
    line = ProgressLine(None, console=Console(file=out, width=120, force_terminal=True))
    line.update(3, {"reward": 0.25})
    line.close()
    assert "train step" not in out.getvalue() and "reward 0.250" in out.getvalue()


def test_the_eta_of_a_resumed_run_counts_from_where_it_resumed():
    out = io.StringIO()
    line = ProgressLine(500, console=Console(file=out, width=200, force_terminal=False))
    line.started -= 10.0  # ten seconds in, at the first step after resuming from 400
    line.update(401, {})
    assert "eta 0:16:3" in out.getvalue(), out.getvalue()  # 99 steps left at 10 s each, not 99 at 10/401 s
