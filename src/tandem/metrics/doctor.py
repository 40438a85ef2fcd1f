"""`tandem doctor`: the tables of symptom → cause → knob from TRL's AsyncGRPOTrainer documentation, applied to a
run's `metrics.jsonl`, for its last window and over the whole run.

Four questions, each answered with the numbers behind it and the knob to turn:
- bottleneck: generation-bound, trainer-bound, staleness bound too tight, concurrency cap bound, server saturated,
  or balanced (queue, rollout wait, backpressure, concurrency against its caps, KV usage);
- the trainer's step: micro-batches of one sample (pack them), a backward that recomputes the forward (gradient
  checkpointing), compute-bound (the first metric pair, perf/step_s against perf/fwd_bwd_s);
- learning health: healthy, saturated at the top, stuck at the bottom, regression, collapse (zero-std groups, the
  reward of dropped groups, duplicates, entropy, truncations);
- sync health: importance-ratio drift, stale drops, the sync's share of a step, the effective sample size and the
  train/inference mismatch.
A critical finding (the run is not learning or not valid) makes `tandem doctor` exit non-zero, so scripts can gate
on it. It reads files a run wrote, with the standard library and the algorithms' own advice
(`tandem.contract.algorithms`, which needs no torch).
"""

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from tandem.contract.algorithms import ALGORITHMS

RUN_CONFIG = "run_config.json"
"""The run's AsyncGRPOConfig, written to its output folder when it starts (a model saved there has config.json)."""
HIGH_SHARE = 0.3
"""A wait is "high" when it takes this share of the step's time or more."""
LOW_SHARE = 0.05
"""A wait is "near zero" below this share of the step's time."""
SYNC_SHARE = 0.2
"""Syncs are worth a knob when they take this share of the training time or more (25% in the third run
of the HF Jobs LoRA async-GRPO blog post)."""
BACKLOG_SHARE = 0.25
"""The server is at capacity when the requests waiting in it are this share of those running or more, in most of the
worker's polls of its /metrics (one poll can catch a burst of requests waiting for the server's next step)."""
FULL_ALLOWANCE = 0.95
"""The token allowance binds when the windows' largest use of it averages this much or more."""
RECOMPUTE_RATIO = 2.8
"""A backward this many times its forward or slower runs the forward again (gradient checkpointing); about 2 is usual.
The HF Jobs LoRA async-GRPO blog post measured 3.2 with checkpointing and 2.5 without it (frozen LoRA bases, FSDP2):
this sits between them."""
LAST_WINDOW = 0.2
"""The last window is this share of the run's logged lines (at least one)."""
MIN_TREND_WINDOWS = 5
"""Logged lines each window needs before a fall of reward or entropy is called (regression, collapse)."""
LOW_SAMPLE_SIZE = 0.9
"""An effective sample size under this: a tenth of the batch's weight is lost to few tokens (VCPO, arXiv 2602.17616,
reads a falling effective sample size as the sign of a coming collapse)."""
SAMPLE_SIZE_FALL = 0.05
"""An effective sample size that falls this much from one window to the next is falling."""
MISMATCH_FLOOR = 1e-3
"""A mismatch KL (nats per token) under this is rounding: float32 against float32 reads 0, bfloat16 about 1e-3."""


@dataclass
class Finding:
    """One answer: its area (bottleneck, learning, sync, run), the verdict, the numbers behind it and the knob."""

    area: str
    verdict: str
    evidence: str
    knob: str = ""
    critical: bool = False

    def line(self) -> str:
        knob = f" -> {self.knob}" if self.knob else ""
        return f"{'CRITICAL ' if self.critical else ''}{self.area}: {self.verdict} ({self.evidence}){knob}"


def mean(rows: list[dict], name: str) -> float | None:
    """The mean of a metric over the rows that logged it (NaN ignored); None when none did."""
    values = [r[name] for r in rows if isinstance(r.get(name), (int, float)) and r[name] == r[name]]
    return statistics.fmean(values) if values else None


def nan_if_none(value: float | None) -> float:
    return float("nan") if value is None else value


def steps_covered(rows: list[dict]) -> list[int]:
    """How many optimizer steps each logged line covers (lines carry the step they were written at)."""
    steps = [r.get("step", 0) or 0 for r in rows]
    return [max(step - previous, 0) for previous, step in zip([steps[0] - 1] + steps[:-1], steps)]


def held_backlog(rows: list[dict]) -> bool:
    """Whether the server held a backlog: in more than half of at least two logged polls of its queue (a row holds the
    mean of the worker's polls in its window, one every few seconds), more requests waiting than those that arrive
    between two of its steps (BACKLOG_SHARE of those running). One poll that caught the groups a step's room had just
    released is no evidence: a pipeline_overlap run whose allowance was full read "server saturated" from polls of 0
    and 48 waiting beside 80-88 running, of 256 it may run."""
    polls = [
        (r["rollout/vllm_queued_requests"], r.get("rollout/vllm_running_requests") or 0.0)
        for r in rows
        if isinstance(r.get("rollout/vllm_queued_requests"), (int, float))
    ]
    held = [queued >= max(1.0, BACKLOG_SHARE * running) for queued, running in polls]
    return len(held) >= 2 and sum(held) > len(held) / 2


def bottleneck(rows: list[dict], config: dict) -> Finding:
    """Where the time goes: an empty queue with training waiting is generation-bound; a full one with generation
    held back is trainer-bound; both at once, max_staleness too tight; the caps and KV usage say which limit binds.
    tandem holds generation back before a group starts (the token allowance of max_staleness steps), so a full
    allowance (rollout/allowance_used_max) is the held-back side's evidence beside the backpressure."""
    step = mean(rows, "perf/step_s") or 0.0
    wait, back = mean(rows, "perf/rollout_wait_s") or 0.0, mean(rows, "rollout/backpressure_s") or 0.0
    queue, per_step = mean(rows, "rollout/queue_size") or 0.0, mean(rows, "batch/samples_per_step") or 1.0
    allowance = mean(rows, "rollout/allowance_used_max")
    wait_high, back_high = step > 0 and wait >= HIGH_SHARE * step, step > 0 and back >= HIGH_SHARE * step
    backlog = held_backlog(rows)
    held = allowance is not None and allowance >= FULL_ALLOWANCE and not backlog  # in flight, not waiting in the server
    # as the HF Jobs LoRA async-GRPO blog post reads them: "queue empty, rollout wait rising, no backpressure:
    # generation is too slow; queue full, rollout wait zero: the trainer is" -- read from the queue when neither
    # wait is high on its own
    starved = wait_high or (queue < per_step and wait >= LOW_SHARE * step and back < LOW_SHARE * step)
    ahead = back_high or (queue >= per_step and (wait < LOW_SHARE * step or (held and not wait_high)))
    evidence = (
        f"step {step:.2f}s, rollout wait {wait:.2f}s, backpressure {back:.2f}s, queue {queue:.0f} samples "
        f"= {queue / per_step:.1f} steps" + (f", allowance used {allowance:.2f}" if allowance is not None else "")
    )
    if wait_high and (back_high or held):
        return Finding(
            "bottleneck",
            "staleness bound too tight",
            evidence,
            f"raise max_staleness (now {config.get('max_staleness', 4)})",
        )
    if starved:
        return generation_limit(rows, config, evidence, backlog)
    if ahead:
        return Finding(
            "bottleneck",
            "trainer-bound",
            evidence,
            "a faster trainer (see the trainer finding; more ranks) or less generation",
        )
    return Finding("bottleneck", "balanced", evidence)


def generation_limit(rows: list[dict], config: dict, evidence: str, backlog: bool) -> Finding:
    """What holds back generation that cannot keep up with training: the server (requests waiting in it, or its KV
    cache full under a lowered concurrency cap), max_concurrent_rollouts, else generation as a whole."""
    queued, running = mean(rows, "rollout/vllm_queued_requests"), mean(rows, "rollout/vllm_running_requests") or 0.0
    concurrency, cap = mean(rows, "rollout/concurrency"), mean(rows, "rollout/concurrency_cap")
    limit, kv = config.get("max_concurrent_rollouts", 512), mean(rows, "rollout/vllm_kv_cache_usage_frac")
    if backlog:
        return Finding(
            "bottleneck",
            "server saturated",
            f"{evidence}; the server runs {running:.0f} requests with {queued:.0f} more waiting",
            "add generation capacity (replicas behind tandem proxy, a faster "
            "server), or a larger --max-num-seqs if its KV cache has room",
        )
    if cap is not None and cap < 0.9 * limit and kv is not None and kv >= 0.8:
        return Finding(
            "bottleneck",
            "server saturated",
            f"{evidence}; concurrency cap {cap:.0f} < {limit}, KV usage {kv:.2f}",
            "add generation capacity (replicas behind tandem proxy, a faster server)",
        )
    if concurrency is not None and concurrency >= 0.9 * limit and (kv is None or kv < 0.5):
        return Finding(
            "bottleneck",
            "concurrency cap bound",
            f"{evidence}; {concurrency:.0f} in flight of "
            f"max_concurrent_rollouts={limit}, KV usage {nan_if_none(kv):.2f}",
            "raise max_concurrent_rollouts",
        )
    return Finding(
        "bottleneck",
        "generation-bound",
        evidence,
        "more generation: raise max_concurrent_rollouts or add replicas (or train on more tokens per step)",
    )


def trainer_step(rows: list[dict], config: dict) -> Finding | None:
    """Where the trainer's step goes: micro-batches of one sample each are latency-bound (pack them into rows), a
    backward far slower than its forward recomputes it (gradient checkpointing), forward+backward near the whole
    step is compute-bound. None when the run logged no step time."""
    step, fwd_bwd, fwd = mean(rows, "perf/step_s"), mean(rows, "perf/fwd_bwd_s"), mean(rows, "perf/fwd_s")
    if not step or not fwd_bwd:
        return None
    per_row, micro = mean(rows, "batch/samples_per_row"), mean(rows, "batch/microbatches_per_step")
    evidence = f"forward+backward {fwd_bwd:.2f}s of step {step:.2f}s ({fwd_bwd / step:.0%})"
    if per_row is not None and micro is not None and per_row < 1.5 and micro >= 8 and not config.get("token_budget"):
        return Finding(
            "trainer",
            "one sample per micro-batch",
            f"{evidence}; {micro:.0f} micro-batches of {per_row:.1f} samples per row",
            "pack samples into rows: set token_budget (and fewer gradient_accumulation_steps)",
        )
    backward = fwd_bwd - fwd if fwd else 0.0
    if fwd and backward >= RECOMPUTE_RATIO * fwd and config.get("gradient_checkpointing", True):
        return Finding(
            "trainer",
            "backward recomputes the forward",
            f"{evidence}; forward {fwd:.2f}s, backward {backward / fwd:.1f}x the forward",
            "gradient_checkpointing=False if the activations fit",
        )
    if fwd_bwd >= 0.8 * step:
        return Finding("trainer", "compute-bound", evidence, "more ranks, or fewer tokens per step")
    return Finding("trainer", "healthy", evidence)


def learning(first: list[dict], last: list[dict], config: dict) -> Finding:
    """Whether the run learns, from `first` to `last`: falls of reward (regression) or entropy with duplicates
    (collapse), then the level of zero-std groups and where the dropped groups' reward sits (rewards in [0, 1])."""
    zero, dropped = mean(last, "frac_reward_zero_std"), mean(last, "reward_dropped")
    reward_then, reward_now = mean(first, "reward"), mean(last, "reward")
    duplicates, clipped = (
        mean(last, "completions/duplicate_frac") or 0.0,
        mean(last, "completions/clipped_ratio") or 0.0,
    )
    entropy_then, entropy_now = mean(first, "entropy"), mean(last, "entropy")
    if reward_now is None:
        return Finding("learning", "no rewarded groups logged", "metrics.jsonl has no reward yet")
    if reward_then is None:  # an earlier window without a scored group: no trend to read
        reward_then = reward_now
    group = config.get("num_generations", 8)
    evidence = (
        f"reward {reward_then:.3f} -> {reward_now:.3f}, zero-std groups {nan_if_none(zero):.2f}, reward of dropped groups "
        f"{nan_if_none(dropped):.2f}, duplicates {duplicates:.2f}, "
        f"truncated {clipped:.2f}"
    )
    trend = min(len(first), len(last)) >= MIN_TREND_WINDOWS  # fewer windows are too noisy to call a fall
    fell = trend and reward_now < reward_then - max(0.1, 0.2 * abs(reward_then))
    entropy_fell = trend and entropy_then and entropy_now is not None and entropy_now < 0.5 * entropy_then
    if group >= 2 and duplicates >= 0.5 * (group - 1) / group and entropy_fell and reward_now <= reward_then:
        return Finding(
            "learning",
            "collapse",
            f"{evidence}, entropy {entropy_then:.3f} -> {entropy_now:.3f}",
            "lower learning_rate, restart from an earlier checkpoint",
            critical=True,
        )
    if fell:
        return Finding(
            "learning",
            "regression",
            evidence,
            "lower learning_rate; check completions/duplicate_frac and entropy for collapse",
            critical=True,
        )
    zero = zero if zero is not None else 0.0  # not logged: no group known to be uniform
    if zero >= 0.5 and dropped is not None and dropped >= 0.5:
        return Finding("learning", "saturated at the top", evidence, "stop, or train on harder prompts")
    if zero >= 0.5:
        cause = "raise max_completion_length" if clipped >= 0.3 else "check the reward function's parsing"
        return Finding("learning", "stuck at the bottom", evidence, cause)
    return Finding("learning", "healthy", evidence)


OFF_POLICY_BOUND = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.05}
"""The largest mean gap between the server's and the trainer's log-probs of the same tokens, at staleness 0, that is
still rounding, by the coarser dtype of the two: fp32 against vLLM's CPU kernels stays near 1e-5 (1.5e-4 at a rare
token, the `vllm` tier's runs); a bf16 tandem serve against an fp32 trainer reached 0.057 on average over a 16-token
probe of the tiny model (0.34 at one token), and fp16 keeps 3 more bits. A larger mean means other weights."""


def rounding_bound(dtypes: list[str | None]) -> tuple[float, str]:
    """The bound of the coarsest of `dtypes` (None: not recorded), and its name; bf16's when none is known."""
    known = [d for d in dtypes if d in OFF_POLICY_BOUND] or ["bfloat16"]
    return max((OFF_POLICY_BOUND[d], d) for d in known)


def off_policy(rows: list[dict], config: dict) -> Finding | None:
    """A step trained on fresh samples only (staleness 0) whose sampler and trainer log-probs differ beyond rounding."""
    bound, dtype = rounding_bound([config.get("compute_dtype"), config.get("server_dtype")])
    gaps = [
        r["sampling/sampling_logp_difference/mean"]
        for r in rows
        if r.get("sample/staleness_max") == 0 and r.get("sampling/sampling_logp_difference/mean") is not None
    ]
    if not gaps or max(gaps) <= bound:
        return None
    return Finding(
        "sync",
        "off-policy at staleness 0",
        f"trained tokens' log-probs differ by {max(gaps):.3g} on average "
        f"between server and trainer on fresh samples; {dtype} rounding stays under {bound:g}",
        "the server samples from other weights: check its --dtype and --logprobs-mode processed_logprobs, and "
        "how weights reach it (set weight_sync_check_atol to probe every sync)",
        critical=True,
    )


def off_policy_drift(before: list[dict], last: list[dict], config: dict) -> Finding | None:
    """The sampler drifting from the trainer: the effective sample size low or falling, or the mismatch KL growing
    (sampling/effective_sample_size, sampling/mismatch_kl), with the correction to try."""
    size_before, size = mean(before, "sampling/effective_sample_size"), mean(last, "sampling/effective_sample_size")
    kl_before, kl = mean(before, "sampling/mismatch_kl"), mean(last, "sampling/mismatch_kl")
    algorithm = ALGORITHMS.get(config.get("algorithm", "grpo"), ALGORITHMS["grpo"])
    knob = "; ".join(
        [
            f"lower max_staleness (now {config.get('max_staleness', 4)})",
            *algorithm.drift_fixes(config),
            "at staleness 0, give the server the trainer's dtype",
        ]
    )
    falling = size is not None and size_before is not None and size_before - size >= SAMPLE_SIZE_FALL
    if size is not None and (falling or size < LOW_SAMPLE_SIZE):
        evidence = f"{size_before:.3f} -> {size:.3f}" if falling else f"{size:.3f}"
        return Finding(
            "sync",
            "effective sample size falls" if falling else "effective sample size low",
            f"sampling/effective_sample_size {evidence}",
            knob,
        )
    if kl is not None and kl_before is not None and kl >= MISMATCH_FLOOR and kl >= 2 * kl_before:
        return Finding("sync", "mismatch grows", f"sampling/mismatch_kl {kl_before:.2g} -> {kl:.2g}", knob)
    return None


def sync(rows: list[dict], config: dict, drift: Finding | None = None) -> list[Finding]:
    """Whether the sampler and the trainer stay close in `rows`: the importance ratio, the log-prob gap at staleness 0,
    samples dropped stale, the syncs' cost, and the drift found between two windows (`off_policy_drift`)."""
    checks = [off_policy(rows, config), importance_ratio(rows, config), dropped_stale(rows, config)]
    checks += [sync_cost(rows, config), drift]
    findings = [finding for finding in checks if finding is not None]
    ratio = mean(rows, "sampling/importance_sampling_ratio/mean")
    return findings or [Finding("sync", "healthy", f"mean ratio {nan_if_none(ratio):.3f}, no stale drops")]


def importance_ratio(rows: list[dict], config: dict) -> Finding | None:
    """The mean importance ratio outside the clip bounds (critical), or drifting from 1."""
    low, high = (
        config.get("vllm_importance_sampling_clip_min", 0.5),
        config.get("vllm_importance_sampling_clip_max", 5.0),
    )
    ratio = mean(rows, "sampling/importance_sampling_ratio/mean")
    if ratio is not None and not low <= ratio <= high:
        return Finding(
            "sync",
            "importance ratio out of bounds",
            f"mean ratio {ratio:.3f} outside [{low}, {high}]",
            "lower max_staleness; check the server's --logprobs-mode processed_logprobs",
            critical=True,
        )
    if ratio is not None and abs(ratio - 1) > 0.05:
        return Finding(
            "sync",
            "importance ratio drifts",
            f"mean ratio {ratio:.3f}",
            "lower max_staleness or sync more often (weight_sync_steps)",
        )
    return None


def dropped_stale(rows: list[dict], config: dict) -> Finding | None:
    """Samples dropped as too stale: critical when as many as were trained."""
    stale = sum(r.get("sample/dropped_stale_count", 0) or 0 for r in rows)
    trained = sum((r.get("batch/samples_per_step", 0) or 0) * steps for r, steps in zip(rows, steps_covered(rows)))
    if stale and stale >= trained:
        return Finding(
            "sync",
            "most samples dropped stale",
            f"{stale:.0f} dropped, ~{trained:.0f} trained",
            f"raise max_staleness (now {config.get('max_staleness', 4)})",
            critical=True,
        )
    if stale:
        return Finding("sync", "some samples dropped stale", f"{stale:.0f} dropped, ~{trained:.0f} trained")
    return None


def sync_cost(rows: list[dict], config: dict) -> Finding | None:
    """Weight syncs that take a large share of each step."""
    waited, step = mean(rows, "perf/weight_sync_wait_s"), mean(rows, "perf/step_s")  # a sync beside a step costs less
    sync_s = waited if waited is not None else mean(rows, "perf/weight_sync_s")  # runs logged before the wait was
    if sync_s and step and sync_s / config.get("weight_sync_steps", 1) >= SYNC_SHARE * step:
        return Finding(
            "sync",
            "syncs take a large share of each step",
            f"sync {sync_s:.2f}s waited per {config.get('weight_sync_steps', 1)} step(s) of {step:.2f}s",
            "raise weight_sync_steps (or, when the server reloads weights from a folder, give it "
            "--weight-transfer-config to stream them)",
        )
    return None


def diagnose(rows: list[dict], config: dict) -> dict[str, list[Finding]]:
    """Findings for the last window (the last fifth of the logged lines, its trend against the fifth before) and for
    the whole run (its trend from the first fifth to the last)."""
    if not rows:
        return {"run": [Finding("run", "nothing logged", "metrics.jsonl is empty", critical=True)]}
    size = max(1, round(LAST_WINDOW * len(rows)))
    first, before, last = rows[:size], rows[-2 * size : -size] or rows[:size], rows[-size:]
    found = {
        "last window": [
            bottleneck(last, config),
            trainer_step(last, config),
            learning(before, last, config),
            *sync(last, config, off_policy_drift(before, last, config)),
        ],
        "whole run": [
            bottleneck(rows, config),
            trainer_step(rows, config),
            learning(first, last, config),
            *sync(rows, config, off_policy_drift(first, last, config)),
        ],
    }
    result = {label: [f for f in findings if f is not None] for label, findings in found.items()}
    if len(last) >= 2 and not any(r.get("batch/samples_per_step") for r in last):
        result["last window"].append(
            Finding(
                "run",
                "no trainable sample",
                f"the last {size} logged windows trained nothing",
                "see why groups were dropped: frac_reward_zero_std, "
                "sample/dropped_stale_count, batch/dropped_oversize_count",
                critical=True,
            )
        )
    return result


def read_run(run_dir: Path) -> tuple[list[dict], dict]:
    """A run's logged windows and its config (run_config.json)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: give the output_dir of a tandem run")
    lines = metrics.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number < len(lines):  # the last line may be one a live (or killed) run is still writing
                raise ValueError(f"{metrics}: line {number} is not JSON ({exc}): {line[:80]!r}") from None
    by_step: dict = {}
    for row in rows:  # an evaluation logs its step on a line of its own, and a resumed run logs its last steps
        by_step.setdefault(row.get("step"), {}).update(row)  # again: a step's lines merge, the later line winning
    return list(by_step.values()), run_config(run_dir)


def run_config(run_dir: Path) -> dict:
    """The run's AsyncGRPOConfig as it wrote it ({} when absent: the defaults apply). Runs before run_config.json wrote
    config.json, which a model saved to the output folder overwrites: read only when it is a run's config."""
    for name in (RUN_CONFIG, "config.json"):
        if (run_dir / name).is_file():
            config = json.loads((run_dir / name).read_text())
            if "num_generations" in config:
                return config
    return {}


def report(run_dir: Path) -> tuple[str, bool]:
    """The doctor's text, and whether any finding is critical."""
    rows, config = read_run(run_dir)
    result = diagnose(rows, config)
    lines = [f"tandem doctor: {run_dir} ({len(rows)} logged windows)"]
    for label, findings in result.items():
        lines.append(f"{label}:")
        lines += [f"  {finding.line()}" for finding in findings]
    return "\n".join(lines), any(f.critical for findings in result.values() for f in findings)
