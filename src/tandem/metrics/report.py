"""`tandem report RUN_DIR`: a run's metrics as plots, with the doctor's findings and the recipe at the top.

Writes `RUN_DIR/report.html`, self-contained (each plot embedded as a PNG data URI, so the one file can be mailed or
attached to an issue), and the same PNGs in `RUN_DIR/report/`. Every run writes it when it ends, on Ctrl-C and on
a crash, from whatever `metrics.jsonl` holds. matplotlib draws with its Agg backend (no display needed) and is
imported only here, when a report is drawn.
"""

import base64
import html
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandem.metrics import doctor

MOVING_AVERAGE = 20
"""Logged windows in the reward's moving average."""


@dataclass
class Panel:
    """One plot: its file name, title, the metrics drawn as lines (those the run logged), and the y label."""

    name: str
    title: str
    lines: list[str] = field(default_factory=list)
    ylabel: str = ""


PANELS = [
    Panel("reward", f"Reward and its moving average over {MOVING_AVERAGE} windows", ylabel="reward"),
    Panel(
        "importance_ratio",
        "Importance ratio trainer/sampler and masked fraction",
        [
            "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/min",
            "sampling/importance_sampling_ratio/max",
        ],
        "ratio",
    ),
    Panel("step_time", "Step time split", ylabel="seconds per step"),
    Panel("queue", "Rollout queue", ["rollout/queue_size", "rollout/score_queue_size"], "samples"),
    Panel(
        "backpressure",
        "Backpressure against rollout wait",
        ["rollout/backpressure_s", "rollout/score_block_s", "perf/rollout_wait_s"],
        "seconds",
    ),
    Panel(
        "staleness",
        "Staleness of trained samples",
        ["sample/staleness_mean", "sample/staleness_max"],
        "policy versions",
    ),
    Panel(
        "concurrency",
        "Rollouts in flight against the concurrency cap",
        ["rollout/concurrency", "rollout/concurrency_cap"],
        "rollouts",
    ),
    Panel("kv_cache", "Generation server KV-cache usage", ["rollout/vllm_kv_cache_usage_frac"], "fraction"),
    Panel("packing", "Packing", ["batch/packing_ratio", "batch/samples_per_row", "batch/row_fill_frac"], "ratio"),
    Panel("throughput", "Generated tokens per second", ["rollout/generated_tokens_per_s"], "tokens/s"),
    Panel("tools", "Tools", ylabel="value"),
    Panel("environment", "Environment", ylabel="seconds"),
]

STEP_PARTS = [
    ("forward", "perf/fwd_s"),
    ("backward", None),
    ("optimizer", "perf/optimizer_s"),
    ("weight sync", "perf/weight_sync_s"),
    ("waiting for rollouts", "perf/rollout_wait_s"),
]
"""The step time's parts, stacked; backward is perf/fwd_bwd_s less perf/fwd_s."""


def value(row: dict, name: str) -> float | None:
    """The row's finite number for `name`, else None."""
    number = row.get(name)
    return number if isinstance(number, (int, float)) and math.isfinite(number) else None


def backward_s(metrics: dict) -> float:
    """The backward's seconds of a logged window: forward+backward less the forward (0 when not logged)."""
    return max((value(metrics, "perf/fwd_bwd_s") or 0.0) - (value(metrics, "perf/fwd_s") or 0.0), 0.0)


def series(rows: list[dict], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that logged `name`."""
    logged = [(row.get("step", 0), value(row, name)) for row in rows]
    points = [(step, number) for step, number in logged if number is not None]
    return [step for step, _ in points], [number for _, number in points]


def moving_average(values: list[float], width: int) -> list[float]:
    """The mean of each value and the up to `width - 1` before it."""
    averages, total = [], 0.0
    for i, number in enumerate(values):
        total += number - (values[i - width] if i >= width else 0.0)
        averages.append(total / min(i + 1, width))
    return averages


def lines_of(panel: Panel, rows: list[dict]) -> list[str]:
    """The metrics a panel draws, as this run logged them (the tools and environment panels take every name
    under their prefix; the reward panel each reward function's mean)."""
    names = sorted({name for row in rows for name in row})
    if panel.name == "reward":  # each reward function's mean, when there are several (one is the reward itself)
        functions = [n for n in names if n.startswith("rewards/") and n.endswith("/mean")]
        return ["reward"] + (functions if len(functions) > 1 else [])
    if panel.name == "tools":
        return [n for n in names if n.startswith("tools/")]
    if panel.name == "environment":
        return [n for n in names if n.startswith("env/")]
    if panel.name == "step_time":
        return [name for _, name in STEP_PARTS if name] + ["perf/step_s"]
    return panel.lines


def draw(panel: Panel, rows: list[dict], config: dict):
    """The panel's matplotlib Figure, or None when the run logged none of its metrics."""
    from matplotlib.figure import Figure

    names = [name for name in lines_of(panel, rows) if series(rows, name)[0]]
    if not names or (panel.name == "step_time" and "perf/step_s" not in names):
        return None
    figure = Figure(figsize=(6.0, 2.8), dpi=90, layout="constrained")  # two side by side on a laptop's screen
    axes = figure.subplots()
    if panel.name == "step_time":
        draw_step_time(axes, rows)
    else:
        for name in names:
            steps, values = series(rows, name)
            axes.plot(steps, values, label=name, linewidth=1.2, alpha=0.45 if name == "reward" else 1.0)
    if panel.name == "reward":
        steps, values = series(rows, "reward")
        axes.plot(steps, moving_average(values, MOVING_AVERAGE), label="reward, moving average", linewidth=2.2)
    if panel.name == "importance_ratio":
        steps, masked = series(rows, "sampling/masked_mean")
        if steps:
            twin = axes.twinx()
            twin.plot(steps, masked, color="tab:gray", linestyle="--", label="sampling/masked_mean")
            twin.set_ylabel("masked fraction")
            twin.legend(loc="upper right", fontsize=7)
    if panel.name == "concurrency" and config.get("max_concurrent_rollouts"):
        axes.axhline(config["max_concurrent_rollouts"], color="tab:red", linestyle=":", label="max_concurrent_rollouts")
    axes.set_title(panel.title, fontsize=10)
    axes.set_xlabel("step")
    axes.set_ylabel(panel.ylabel)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize=7)
    return figure


def draw_step_time(axes, rows: list[dict]) -> None:
    """Forward, backward, optimizer, sync and rollout wait stacked per logged window, the whole step on top."""
    timed = [row for row in rows if value(row, "perf/step_s") is not None]
    steps = [row.get("step", 0) for row in timed]
    parts = []
    for _label, name in STEP_PARTS:
        if name is None:  # backward: what forward+backward took beyond the forward
            parts.append([backward_s(r) for r in timed])
        else:
            parts.append([value(r, name) or 0.0 for r in timed])
    axes.stackplot(steps, *parts, labels=[label for label, _ in STEP_PARTS], alpha=0.8)
    axes.plot(steps, [value(r, "perf/step_s") for r in timed], color="black", linewidth=1, label="perf/step_s")


def png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def write(run_dir: Path) -> Path:
    """Draw every panel the run has metrics for; write report.html and the PNGs; return the html's path."""
    rows, config = doctor.read_run(run_dir)
    findings = doctor.diagnose(rows, config)
    images, missing = [], []
    (run_dir / "report").mkdir(exist_ok=True)
    for old in (run_dir / "report").glob("*.png"):  # a panel drawn last time may have nothing to show now
        old.unlink()
    for panel in PANELS:
        figure = draw(panel, rows, config)
        if figure is None:
            missing.append(panel.title)
            continue
        data = png(figure)
        (run_dir / "report" / f"{panel.name}.png").write_bytes(data)
        images.append((panel, data))
    path = run_dir / "report.html"
    path.write_text(page(run_dir, rows, config, findings, images, missing))
    return path


def summary(rows: list[dict]) -> str:
    """Steps, duration and the reward's first and last 20 windows."""
    steps = max((row.get("step", 0) for row in rows), default=0)
    times = [row["time"] for row in rows if isinstance(row.get("time"), (int, float))]
    took = f", {(times[-1] - times[0]) / 60:.1f} min" if len(times) >= 2 else ""
    _, rewards = series(rows, "reward")
    reward = ""
    if rewards:
        first, last = rewards[:MOVING_AVERAGE], rewards[-MOVING_AVERAGE:]
        reward = (
            f", reward {sum(first) / len(first):.3f} → {sum(last) / len(last):.3f} (first / last "
            f"{MOVING_AVERAGE} windows)"
        )
    return f"{len(rows)} logged windows, step {steps}{took}{reward}"


STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
li.critical{color:#b00020;font-weight:600} figure{display:inline-block;margin:.5em} img{max-width:100%}
pre{background:#f6f6f6;padding:1em;overflow-x:auto} .muted{color:#777}"""


def page(run_dir: Path, rows: list[dict], config: dict, findings: dict, images: list, missing: list[str]) -> str:
    """The self-contained HTML page."""
    out = [
        f"<!doctype html><html lang=en><meta charset=utf-8><title>tandem report: {html.escape(run_dir.name)}</title>",
        f"<style>{STYLE}</style><h1>tandem report: {html.escape(str(run_dir))}</h1>",
        f"<p>{html.escape(summary(rows))}. Written {time.strftime('%Y-%m-%d %H:%M:%S')}.</p>",
        "<h2>Doctor</h2>",
    ]
    for label, found in findings.items():
        out.append(f"<h3>{html.escape(label)}</h3><ul>")
        out += [f"<li class={'critical' if f.critical else 'finding'}>{html.escape(f.line())}</li>" for f in found]
        out.append("</ul>")
    recipe = json.dumps(config, indent=2, default=str) if config else "(no run_config.json in the run folder)"
    out.append(f"<h2>Recipe</h2><details><summary>run_config.json</summary><pre>{html.escape(recipe)}</pre></details>")
    out.append("<h2>Metrics</h2>")
    for panel, data in images:
        encoded = base64.b64encode(data).decode()
        out.append(f"<figure><img alt='{html.escape(panel.title)}' src='data:image/png;base64,{encoded}'></figure>")
    if missing:
        out.append(f"<p class=muted>Not logged in this run: {html.escape(', '.join(missing))}.</p>")
    return "\n".join(out) + "\n</html>\n"
