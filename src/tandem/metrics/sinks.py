"""Where metrics go: `metrics.jsonl` in the output folder always, and trackio / tensorboard / wandb (offline) when
`report_to` names them. The console is metrics/console.py's.

The sinks log each metric under its catalogue name (`reward`, `perf/step_s`, `eval/reward`), as TRL's
dashboards show them; transformers' integration callbacks would rename them `train/...`."""

import importlib.util
import json
import time
from pathlib import Path
from typing import TextIO

from tandem.errors import install_command

COLUMNS = ["step", "prompt", "completion", "reward"]
"""The completions table (log_completions): one row per completion of the logging window."""


def completion_rows(step: int, examples: list) -> list[list]:
    """(prompt, completion, reward) examples as table rows; a chat prompt shows its last message."""
    return [
        [step, prompt[-1]["content"] if isinstance(prompt, list) else str(prompt), completion, float(reward)]
        for prompt, completion, reward in examples
    ]


class JsonlSink:
    """metrics.jsonl, and completions.jsonl beside it for the completions table (metrics.jsonl stays numbers only)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open(path, "a", buffering=1)
        self.completions: TextIO | None = None

    def log(self, step: int, metrics: dict) -> None:
        self.file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def log_table(self, step: int, rows: list[list]) -> None:
        if self.completions is None:
            self.completions = open(self.path.with_name("completions.jsonl"), "a", buffering=1)
        for row in rows:
            self.completions.write(json.dumps(dict(zip(COLUMNS, row))) + "\n")

    def close(self) -> None:
        self.file.close()
        if self.completions is not None:
            self.completions.close()


def markdown_cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


class TensorboardSink:
    def __init__(self, folder: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "report_to='tensorboard' needs the tensorboard package: " + install_command("tensorboard")
            ) from exc
        self.writer = SummaryWriter(str(folder))

    def log(self, step: int, metrics: dict) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def log_table(self, step: int, rows: list[list]) -> None:
        """A markdown table under the text tag `completions`: TensorBoard's text dashboard renders it."""
        lines = ["| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
        lines += ["| " + " | ".join(markdown_cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text("completions", "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """An offline wandb run in the output folder (`wandb sync` uploads it), under `project` and `run_name`."""

    def __init__(self, folder: Path, config: dict):
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("report_to='wandb' needs the wandb package: " + install_command("wandb")) from exc
        self.run = wandb.init(
            mode="offline", dir=str(folder), project=config["project"], name=config["run_name"], config=config
        )

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, step: int, rows: list[list]) -> None:
        import wandb

        self.run.log({"completions": wandb.Table(columns=list(COLUMNS), data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioSink:
    """A trackio run under `project` and `run_name`: local, or hosted on `trackio_space_id` (synced to
    `trackio_bucket_id`); a hosted run is frozen into a static Space when it ends unless `trackio_static_space_id` is
    False (transformers' convention)."""

    def __init__(self, config: dict):
        try:
            import trackio
        except ImportError as exc:
            raise ImportError("report_to='trackio' needs the trackio package: " + install_command("trackio")) from exc
        self.trackio, self.config = trackio, config
        trackio.init(
            project=config["project"],
            name=config["run_name"],
            space_id=config["trackio_space_id"],
            bucket_id=config["trackio_bucket_id"],
            config=config,
            resume="allow",
        )

    def log(self, step: int, metrics: dict) -> None:
        self.trackio.log(metrics, step=step)

    def log_table(self, step: int, rows: list[list]) -> None:
        self.trackio.log({"completions": self.trackio.Table(columns=COLUMNS, data=rows)}, step=step)

    def close(self) -> None:
        self.trackio.finish()
        static, space = self.config["trackio_static_space_id"], self.config["trackio_space_id"]
        if space and static is not False:
            self.trackio.freeze(space_id=space, project=self.config["project"], new_space_id=static or None)


INTEGRATIONS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
"""report_to names and the module each needs: report_to='all' takes those installed."""


def make_sinks(report_to, output_dir: Path, config: dict) -> list:
    """The sinks of `report_to`; `config` is the run's AsyncGRPOConfig as a dict (names, projects, Spaces)."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if "all" in names:  # transformers' meaning: every integration that is installed
        names = [name for name, module in INTEGRATIONS.items() if importlib.util.find_spec(module)]
    names = [n for n in names if n not in ("none", "")]
    sinks: list = [JsonlSink(output_dir / "metrics.jsonl")]
    for name in names:
        if name == "tensorboard":
            sinks.append(TensorboardSink(output_dir / "runs"))
        elif name == "wandb":
            sinks.append(WandbSink(output_dir, config))
        elif name == "trackio":
            sinks.append(TrackioSink(config))
        else:
            raise ValueError(f"report_to={name!r} is not one of: none, tensorboard, wandb, trackio")
    return sinks
