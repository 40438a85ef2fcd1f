"""Where metrics go: `metrics.jsonl` in the output folder always, a progress line on the console (live in a
terminal, plain lines elsewhere), and trackio / tensorboard / wandb (offline) when `report_to` names them."""

import json
import time
from datetime import timedelta
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class JsonlSink:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open(path, "a", buffering=1)

    def log(self, step: int, metrics: dict) -> None:
        self.file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def close(self) -> None:
        self.file.close()


class TensorboardSink:
    def __init__(self, folder: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError("report_to='tensorboard' needs the tensorboard package: pip install 'tandem[tensorboard]'") from exc
        self.writer = SummaryWriter(str(folder))

    def log(self, step: int, metrics: dict) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, folder: Path, run_name: str | None, config: dict):
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("report_to='wandb' needs the wandb package: pip install 'tandem[wandb]'") from exc
        self.run = wandb.init(mode="offline", dir=str(folder), name=run_name, config=config)

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioSink:
    def __init__(self, run_name: str | None, config: dict):
        try:
            import trackio
        except ImportError as exc:
            raise ImportError("report_to='trackio' needs the trackio package: pip install 'tandem[trackio]'") from exc
        self.trackio = trackio
        trackio.init(project="tandem", name=run_name, config=config)

    def log(self, step: int, metrics: dict) -> None:
        self.trackio.log(metrics, step=step)

    def close(self) -> None:
        self.trackio.finish()


def make_sinks(report_to, output_dir: Path, run_name: str | None, config: dict) -> list:
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    names = [n for n in names if n not in ("none", "")]
    sinks: list = [JsonlSink(output_dir / "metrics.jsonl")]
    for name in names:
        if name == "tensorboard":
            sinks.append(TensorboardSink(output_dir / "runs"))
        elif name == "wandb":
            sinks.append(WandbSink(output_dir, run_name, config))
        elif name == "trackio":
            sinks.append(TrackioSink(run_name, config))
        else:
            raise ValueError(f"report_to={name!r} is not one of: none, tensorboard, wandb, trackio")
    return sinks


class ProgressLine:
    """Step, reward, step time, queue, staleness and ETA: one live line in a terminal; elsewhere (a pipe, a log file,
    CI) one plain line per logged window, never cut to the console's width."""

    def __init__(self, total_steps: int | None, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.total_steps, self.started, self.first_step = total_steps, time.monotonic(), None
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False,
        )
        self.task = self.progress.add_task("waiting for the first samples", total=total_steps)
        if self.console.is_terminal:
            self.progress.start()

    def update(self, step: int, metrics: dict) -> None:
        parts = []
        for label, name, fmt in (("reward", "reward", ".3f"), ("step", "perf/step_s", ".2f"), ("queue", "rollout/queue_size", ".0f"),
                                 ("stale", "sample/staleness_mean", ".1f")):
            if name in metrics:
                parts.append(f"{label} {metrics[name]:{fmt}}" + ("s" if label == "step" else ""))
        self.progress.update(self.task, completed=step, description="  ".join(parts))
        if not self.console.is_terminal:
            self.console.print(self._plain(step, parts), soft_wrap=True, highlight=False, markup=False)

    def _plain(self, step: int, parts: list[str]) -> str:
        """`train step 12/300  reward 0.412 ...  elapsed 0:00:42  eta 0:03:10`: the live line's content as text."""
        elapsed = time.monotonic() - self.started
        if self.first_step is None:  # a resumed run starts counting where it resumed
            self.first_step = step - 1
        done = step - self.first_step
        of = f"/{self.total_steps}" if self.total_steps else ""
        eta = [f"eta {timedelta(seconds=round(elapsed / done * (self.total_steps - step)))}"] if self.total_steps and done > 0 else []
        return "  ".join([f"train step {step}{of}", *parts, f"elapsed {timedelta(seconds=round(elapsed))}", *eta])

    def print_completions(self, examples: list, limit: int | None) -> None:
        table = Table("prompt", "completion", "reward", title="completions")
        for prompt, completion, reward in examples[: limit or len(examples)]:
            text = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
            table.add_row(text, completion, f"{reward:.2f}")
        self.progress.console.print(table)

    def close(self) -> None:
        if self.console.is_terminal:
            self.progress.stop()
