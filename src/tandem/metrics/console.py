"""What a run shows on the console while it trains.

In a terminal, a live dashboard (rich): progress and ETA, the reward with a sparkline, the four metric pairs that show
where a run's bottleneck is (step against forward+backward, rollout wait, queue against a step's samples, backpressure
against score block), the step time split, staleness, ratio and concurrency. Elsewhere (a pipe, a log file, CI), one
plain line per logged window, never cut to the console's width. In both, a one-line `doctor:` warning when one of the
doctor's findings for the recent windows changes (metrics/doctor.py).
"""

import math
import time
from collections import deque
from datetime import timedelta

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from tandem.metrics import doctor
from tandem.metrics.report import backward_s

SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40
"""Logged windows in the reward's sparkline."""
RECENT = 200
"""Logged windows the console's doctor reads (its last window is the last fifth of them)."""
SETTLE = 10
"""Logged windows a changed finding must hold before it is announced (one noisy window is not a change)."""


def sparkline(values: list[float]) -> str:
    """One block character per value, from the lowest to the highest of them (finite values only)."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = high - low or 1.0
    return "".join(SPARK[min(int((v - low) / span * len(SPARK)), len(SPARK) - 1)] for v in values)


class FindingWatch:
    """The doctor's findings for the recent logged windows, announced when they change: a new verdict in an area
    (bottleneck, trainer, learning, sync) once it held for SETTLE windows; healthy ones only as a change back."""

    def __init__(self, config: dict):
        self.config = config
        self.rows: deque[dict] = deque(maxlen=RECENT)
        self.shown: dict[str, tuple] = {}
        self.pending: dict[str, tuple[tuple, int]] = {}

    def update(self, step: int, metrics: dict) -> list[doctor.Finding]:
        """Add a logged window; return the findings that changed with it."""
        self.rows.append({**metrics, "step": step})
        if len(self.rows) < 2 * doctor.MIN_TREND_WINDOWS:
            return []
        by_area: dict[str, list[doctor.Finding]] = {}
        for finding in doctor.diagnose(list(self.rows), self.config)["last window"]:
            by_area.setdefault(finding.area, []).append(finding)
        for area in set(self.shown) - set(by_area):  # an area gone quiet: its next finding is news again
            self.shown.pop(area), self.pending.pop(area, None)
        changed = []
        for area, findings in by_area.items():
            verdicts = tuple(f.verdict for f in findings)
            seen, count = self.pending.get(area, (None, 0))
            self.pending[area] = (verdicts, count + 1 if seen == verdicts else 1)
            if self.pending[area][1] < SETTLE or self.shown.get(area) == verdicts:
                continue
            quiet = all(f.verdict in ("healthy", "balanced") for f in findings)
            if area in self.shown or not quiet:
                changed += findings
            self.shown[area] = verdicts
        return changed


class RunConsole:
    """The run's console: the live dashboard in a terminal, plain lines elsewhere, and the doctor's warnings."""

    def __init__(
        self,
        total_steps: int | None,
        config: dict | None = None,
        console: Console | None = None,
        dashboard: bool = True,
    ):
        self.console = console or Console(stderr=True)
        self.total_steps, self.started = total_steps, time.monotonic()
        self.first_step: int | None = None
        self.step = 0
        self.rewards: deque[float] = deque(maxlen=SPARK_WIDTH)
        self.metrics: dict = {}
        self.latest: dict = {}
        """The last window's metrics (the plain line), and each metric's latest value (the dashboard: a window
        without a metric, such as the last one after the worker finished, keeps showing the one before)."""
        self.watch: FindingWatch | None = FindingWatch(config or {})
        self.live = None
        if self.console.is_terminal and dashboard:
            self.live = Live(get_renderable=self.dashboard, console=self.console, refresh_per_second=2, transient=False)
            self.live.start()

    def update(self, step: int, metrics: dict) -> None:
        if self.first_step is None:  # a resumed run counts its ETA from where it resumed
            self.first_step = step - 1
        self.step, self.metrics = step, metrics
        self.latest.update(metrics)
        if "reward" in metrics:
            self.rewards.append(metrics["reward"])
        if self.live is None:
            self.console.print(self.plain_line(), soft_wrap=True, highlight=False, markup=False)
        if self.watch is None:
            return
        try:
            changed = self.watch.update(step, metrics)
        except Exception as exc:  # noqa: BLE001 - the console's doctor must never stop training
            self.console.print(
                f"doctor: stopped reading this run's windows ({exc!r}); run `tandem doctor` on its folder",
                soft_wrap=True,
                highlight=False,
                markup=False,
            )
            self.watch = None
            return
        for finding in changed:
            style = "bold red" if finding.critical else "yellow"
            self.console.print(Text(f"doctor: {finding.line()}", style=style), soft_wrap=True, highlight=False)

    # ---- what is shown --------------------------------------------------------------------------
    def timing(self) -> tuple[str, str]:
        """Elapsed and ETA as text ('' for the ETA when it cannot be told yet)."""
        elapsed = time.monotonic() - self.started
        done = self.step - (self.first_step or 0)
        eta = ""
        if self.total_steps and self.first_step is not None and done > 0:
            eta = str(timedelta(seconds=round(elapsed / done * max(self.total_steps - self.step, 0))))
        return str(timedelta(seconds=round(elapsed))), eta

    def headline(self) -> list[str]:
        """Reward, step time, queue and staleness, the parts of the plain line."""
        parts = []
        for label, name, fmt, unit in (
            ("reward", "reward", ".3f", ""),
            ("step", "perf/step_s", ".2f", "s"),
            ("queue", "rollout/queue_size", ".0f", ""),
            ("stale", "sample/staleness_mean", ".1f", ""),
        ):
            if name in self.metrics:
                parts.append(f"{label} {self.metrics[name]:{fmt}}{unit}")
        return parts

    def step_label(self) -> str:
        return f"train step {self.step}" + (f"/{self.total_steps}" if self.total_steps else "")

    def plain_line(self) -> str:
        """`train step 12/300  reward 0.412 ...  elapsed 0:00:42  eta 0:03:10`."""
        elapsed, eta = self.timing()
        return "  ".join([self.step_label(), *self.headline(), f"elapsed {elapsed}", *([f"eta {eta}"] if eta else [])])

    def number(self, name: str, fmt: str = ".2f", unit: str = "") -> str:
        value = self.latest.get(name)
        return f"{value:{fmt}}{unit}" if isinstance(value, (int, float)) else "–"

    def dashboard(self):
        """The live view: progress, reward and its sparkline, the four metric pairs, the step split, sync health."""
        elapsed, eta = self.timing()
        top = Table.grid(padding=(0, 2))
        top.add_row(
            Text(self.step_label(), style="bold"),
            ProgressBar(total=self.total_steps or None, completed=self.step, width=30),
            f"elapsed {elapsed}" + (f"  eta {eta}" if eta else ""),
        )
        if not self.latest:
            return Group(top, Text("waiting for the first samples", style="dim"))
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="cyan", no_wrap=True)
        grid.add_column()
        grid.add_row("reward", f"{self.number('reward', '.3f')}  {sparkline(list(self.rewards))}")
        grid.add_row(
            "step / forward+backward",
            f"{self.number('perf/step_s', unit='s')} / {self.number('perf/fwd_bwd_s', unit='s')}",
        )
        grid.add_row("rollout wait", self.number("perf/rollout_wait_s", unit="s"))
        grid.add_row(
            "queue / samples per step",
            f"{self.number('rollout/queue_size', '.0f')} / {self.number('batch/samples_per_step', '.0f')}",
        )
        grid.add_row(
            "backpressure / score block",
            f"{self.number('rollout/backpressure_s', unit='s')} / {self.number('rollout/score_block_s', unit='s')}",
        )
        grid.add_row(
            "step split",
            f"forward {self.number('perf/fwd_s')}  backward {backward_s(self.latest):.2f}  optimizer "
            f"{self.number('perf/optimizer_s')}  sync {self.number('perf/weight_sync_s')}  "
            f"wait {self.number('perf/rollout_wait_s')} (s)",
        )
        grid.add_row(
            "staleness / ratio",
            f"{self.number('sample/staleness_mean', '.1f')} (max "
            f"{self.number('sample/staleness_max', '.0f')}) / "
            f"{self.number('sampling/importance_sampling_ratio/mean', '.3f')}",
        )
        grid.add_row(
            "in flight / cap",
            f"{self.number('rollout/concurrency', '.0f')} / {self.number('rollout/concurrency_cap', '.0f')}",
        )
        return Group(top, grid)

    def say(self, text: str) -> None:
        """A line about the run (above the dashboard in a terminal), never cut."""
        self.console.print(Text(f"tandem: {text}", style="yellow"), soft_wrap=True, highlight=False)

    def print_completions(self, examples: list, limit: int | None) -> None:
        """The first `limit` examples as a table (None: all of them; 0: none)."""
        shown = examples if limit is None else examples[:limit]
        if not shown:
            return
        table = Table("prompt", "completion", "reward", title="completions")
        for prompt, completion, reward in shown:
            text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
            table.add_row(text, completion, f"{reward:.2f}")
        self.console.print(table)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
