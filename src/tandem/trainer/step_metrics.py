"""What one optimizer step records: its rows, its samples, its timings (names from the metric catalogue).

Pure functions from a step's facts to window records, so the training loop only says when to record.
"""

import resource
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.contract.staleness import staleness
from tandem.metrics.window import MetricWindow
from tandem.packing import PADDED, PackedRow


@dataclass
class StepTimes:
    """Seconds a step spent in each phase (`perf/*_s`)."""

    total: float
    rollout_wait: float
    forward: float
    forward_backward: float
    optimizer: float


def input_tokens(rows: list[PackedRow], counted: str | bool) -> int:
    """The step's forwarded tokens as include_num_input_tokens_seen counts them: "all" (True) every one, a padded row's
    padding included; "non_padding" without it (a tree row has none); "no" (False) none."""
    if counted in ("no", False):
        return 0
    if counted == "non_padding":
        return sum(row.raw_tokens if row.layout == PADDED else row.num_tokens for row in rows)
    return sum(row.num_tokens for row in rows)


def record_samples(window: MetricWindow, rows: list[PackedRow], model_version: int, kept_cache: bool = True) -> None:
    """Staleness, size and rewards of every sample the step trained (its time in the queue is the runtime's, at
    take), the lag of each trained token behind the weights being trained, and the share sampled after a weight
    update over the cache older weights computed (`kept_cache`: the server keeps it; else each token is one
    version's)."""
    for sample in (s for row in rows for s in row.samples):
        lag = staleness(model_version, sample.model_version)
        window.add("sample/staleness_mean", lag)
        window.add("sample/staleness_max", lag)
        token_lags = [staleness(model_version, version) for version in sample.trained_versions()]
        window.add("sample/token_lag_mean", *token_lags)
        window.add("sample/token_lag_max", *token_lags)
        mixed = sample.mixed_tokens() if kept_cache else 0
        window.add("sample/mixed_tokens_frac", mixed / max(sample.num_trained, 1))
        window.add("sample/forwarded_tokens_mean", sample.num_tokens)
        window.add("sample/forwarded_tokens_max", sample.num_tokens)
        window.add("sample/trained_tokens_mean", sample.num_trained)
        window.add("reward_kept", sample.reward)  # over trained samples
        window.add("reward_group_std", sample.group_reward_std)
        for source, std in sample.source_group_stds.items():
            window.add(f"rewards/{source}/group_std", std)


def record_step(window: MetricWindow, rows: list[PackedRow], num_micro_batches: int, times: StepTimes) -> None:
    """The step's totals and throughput: tokens forwarded (shared prefixes once) and trained, per second."""
    samples = [s for row in rows for s in row.samples]
    tokens = sum(row.num_tokens for row in rows)
    trained = sum(row.num_trained for row in rows)
    predicting = sum(row.predict_index.unique().numel() for row in rows)
    window.add("perf/step_s", times.total)
    window.add("perf/rollout_wait_s", times.rollout_wait)
    window.add("perf/fwd_s", times.forward)
    window.add("perf/fwd_bwd_s", times.forward_backward)
    window.add("perf/optimizer_s", times.optimizer)
    window.add("perf/fwd_bwd_forwarded_tokens_per_s", (tokens, times.forward_backward))
    window.add("perf/fwd_bwd_trained_tokens_per_s", (trained, times.forward_backward))
    window.add("perf/wall_clock_forwarded_tokens_per_s", (tokens, times.total))
    window.add("perf/wall_clock_trained_tokens_per_s", (trained, times.total))
    window.add("batch/forwarded_tokens_per_step", tokens)
    window.add("batch/trained_tokens_per_step", trained)
    window.add("batch/samples_per_step", len(samples))
    window.add("batch/groups_per_step", len({s.group_id for s in samples}))
    window.add("batch/microbatches_per_step", num_micro_batches)
    window.add("batch/masked_token_frac", 1 - predicting / tokens)


GIB = 2**30


def record_memory(window: MetricWindow, device: torch.device) -> None:
    """skip_memory_metrics=False: the process's resident host memory now and, on a GPU, its peak allocation since the
    last step (the peak is reset here, so each step reports its own)."""
    window.add("memory/host_rss_max_gib", host_rss_bytes() / GIB)
    if device.type == "cuda":
        window.add("memory/cuda_max_allocated_gib", torch.cuda.max_memory_allocated(device) / GIB)
        torch.cuda.reset_peak_memory_stats(device)


def host_rss_bytes() -> int:
    """Resident memory of this process: /proc's current figure on Linux, the peak elsewhere (getrusage)."""
    statm = Path("/proc/self/statm")
    if statm.is_file():
        return int(statm.read_text().split()[1]) * resource.getpagesize()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS
