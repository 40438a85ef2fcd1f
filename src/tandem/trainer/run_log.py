"""The run's log: the metric window that each step and the rollout worker add to, and what outlives a window — each
step's loss (`training_loss` is their mean) and each logged window's mean reward (the CLI's last line compares the
first twenty with the last twenty)."""

import math
from dataclasses import dataclass, field

from tandem.config import AsyncGRPOConfig
from tandem.metrics.window import MetricWindow
from tandem.packing import PackedRow
from tandem.trainer.checkpoint import TrainerState
from tandem.trainer.step_metrics import StepTimes, record_step


@dataclass
class RunLog:
    args: AsyncGRPOConfig
    """The run's settings, read as each step and each log is recorded: `logging_nan_inf_filter` (False: a NaN or
    infinite step loss is logged as the window's loss, as in transformers) and `include_num_input_tokens_seen`."""
    epoch_size: int | None = None
    """The dataset's length (None for a stream or environments): a logged line carries the epoch reached."""
    agent: bool = False
    """The run has tools or environments: `tools/failure_frequency` is NaN in a window without a call."""
    window: MetricWindow = field(default_factory=MetricWindow)
    losses: list[float] = field(default_factory=list)
    reward_history: list[float] = field(default_factory=list)
    nonfinite_loss: float | None = None
    """The window's last NaN or infinite loss, logged as its `loss` when logging_nan_inf_filter is False."""

    @property
    def training_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else 0.0

    def record_step(
        self,
        rows: list[PackedRow],
        num_micro_batches: int,
        loss: float,
        grad_norm: float,
        learning_rate: float,
        times: StepTimes,
    ) -> None:
        """One optimizer step's loss, gradient norm, learning rate, totals and timings."""
        if math.isfinite(loss):
            self.losses.append(loss)
            self.window.add("loss", loss)
        elif not self.args.logging_nan_inf_filter:  # as transformers: the logged loss and training_loss show it
            self.nonfinite_loss = loss
            self.losses.append(loss)
        self.window.add("grad_norm", grad_norm)
        self.window.add("learning_rate", learning_rate)
        record_step(self.window, rows, num_micro_batches, times)

    def flush(self, state: TrainerState) -> tuple[dict, list | None]:
        """The window reduced into one logged line with the run's counters, and the completions it sampled to print;
        the window starts again empty."""
        examples = self.window.values.get("completions/examples")
        metrics = self.window.flush()
        metrics["num_tokens"] = state.num_tokens
        if self.args.include_num_input_tokens_seen not in ("no", False):
            metrics["num_input_tokens_seen"] = state.num_input_tokens_seen
        if self.nonfinite_loss is not None:
            metrics["loss"], self.nonfinite_loss = self.nonfinite_loss, None
        metrics["model_version"] = state.model_version
        if self.epoch_size is not None:
            metrics["epoch"] = state.dataset_start_index / self.epoch_size
        if self.agent:
            metrics.setdefault("tools/failure_frequency", math.nan)  # no call in the window
        if "reward" in metrics:
            self.reward_history.append(metrics["reward"])
        return metrics, examples
