"""Where metrics go: `metrics.jsonl` in the output folder always, and trackio / tensorboard / wandb (offline) when
`report_to` names them. The console is metrics/console.py's."""

import json
import time
from pathlib import Path


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
