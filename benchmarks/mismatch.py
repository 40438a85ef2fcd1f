"""The off-policy corrections against a real train/inference mismatch: bfloat16 on this CPU, two ways.

A GPU user's sampler and trainer never agree bit for bit: vLLM's bfloat16 kernels differ from the trainer's. On this
CPU (it has avx512_bf16) the same happens in small:

- `bf16 trainer, bf16 server`: the trainer's forward in bfloat16 (`--bf16 true`: autocast over float32 weights, the
  sdpa tree kernel) behind `tandem serve --dtype bfloat16` (the weights themselves in bfloat16);
- `fp32 trainer, bf16 server`: the trainer in float32 behind the same server.

Each runs the demo (`examples/demo.yaml`, 300 steps) with every correction, at `max_staleness` 1 and 8:

- `none`: the plain importance ratio (bounds [0, 1e9]: nothing masked);
- `token_mask`: the default, a token whose ratio leaves [0.5, 5] is masked;
- `token_truncate`: each token's weight capped at 5;
- `geometric_mask`: a sample is masked when the geometric mean of its ratios leaves [0.5, 5];
- `gspo`: `importance_sampling_level: sequence` with GSPO's trust region (epsilon 3e-4, epsilon_high 4e-4; it needs
  the clipped surrogate, the others keep the demo's score centering).

Each cell is the median of `--runs` runs (seeds 0, 1, ...): the reward of the first and last 20 steps, the seconds
until the mean reward of 20 steps first reaches 0.7, and the run's mean effective sample size and mismatch KL. With
`--markdown`, the reward curves of the first run of each cell are plotted to docs/images/mismatch_reward.png.

The 60 runs take about 2.5 hours. Each finished run is kept in runs/benchmarks/mismatch.jsonl, so a refresh that was
stopped goes on where it stopped: a run kept there is reused while the code it measured (src/, the demo's recipe, this
script) is the same as at its commit, and `--fresh` measures every run again.

    python benchmarks/mismatch.py [--runs 3] [--steps 300] [--fresh] [--markdown PATH]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tables import add_markdown_flag, emit, markdown_table

ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "docs" / "images" / "mismatch_reward.png"
KEPT = ROOT / "runs" / "benchmarks" / "mismatch.jsonl"
"""Each finished run: its cell, seed and steps, the commit it ran at, and its summary."""
MEASURED = ["src", "examples/demo.yaml", "benchmarks/mismatch.py"]
"""What a kept run measured: it is reused only while these are as they were at its commit."""
WINDOW, TARGET = 20, 0.7
STALENESS = (1, 8)
CORRECTIONS = {
    "none": ["--vllm_importance_sampling_clip_min", "0", "--vllm_importance_sampling_clip_max", "1e9"],
    "token_mask": [],
    "token_truncate": ["--vllm_importance_sampling_mode", "token_truncate"],
    "geometric_mask": ["--vllm_importance_sampling_mode", "geometric_mask"],
    "gspo": [
        "--importance_sampling_level",
        "sequence",
        "--score_centering",
        "false",
        "--epsilon",
        "3e-4",
        "--epsilon_high",
        "4e-4",
    ],
}
SETUPS = {
    "bf16 trainer, bf16 server": ["--bf16", "true", "--tree_attention_kernel", "sdpa"],
    "fp32 trainer, bf16 server": [],
}
"""The trainer's flags; each run has a server of its own, started in bfloat16 (`run`): the embedded server would serve
the trainer's float32 weights in float32, even under --bf16 true (an autocast)."""


def run(setup: str, correction: str, staleness: int, steps: int, seed: int) -> list[dict]:
    """One `tandem train examples/demo.yaml`; its logged steps with a reward."""
    from tandem.generation.launcher import EmbeddedServer
    from tandem.tasks import TINY_MODEL_PATH

    flags = [*SETUPS[setup], *CORRECTIONS[correction], "--max_staleness", str(staleness)]
    flags += ["--max_steps", str(steps), "--seed", str(seed), "--disable_tqdm", "true", "--save_strategy", "no"]
    served = ["--dtype", "bfloat16", "--logprobs-mode", "processed_logprobs", "--served-model-name", TINY_MODEL_PATH]
    served += ["--weight-transfer-config", '{"backend": "gloo"}']  # weights streamed, as to the embedded server
    with tempfile.TemporaryDirectory() as out, EmbeddedServer("tiny", extra_args=served) as started:
        flags += ["--vllm_server_base_url", started.url]
        command = [sys.executable, "-m", "tandem", "train", "examples/demo.yaml", "--output_dir", out, *flags]
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        logged = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [m for m in logged if "reward" in m and "batch/samples_per_step" in m]


def summary(rows: list[dict]) -> dict:
    """One run's figures: reward first/last 20 steps, seconds to a 20-step mean of 0.7 (None: never), mean effective
    sample size and mismatch KL."""
    rewards = [r["reward"] for r in rows]
    start = rows[0]["time"] - rows[0]["perf/step_s"]
    reached = next(
        (
            rows[i]["time"] - start
            for i in range(WINDOW - 1, len(rows))
            if statistics.mean(rewards[i - WINDOW + 1 : i + 1]) >= TARGET
        ),
        None,
    )
    return {
        "first": statistics.mean(rewards[:WINDOW]),
        "last": statistics.mean(rewards[-WINDOW:]),
        "reached": reached,
        "ess": statistics.mean(r["sampling/effective_sample_size"] for r in rows),
        "kl": statistics.mean(r["sampling/mismatch_kl"] for r in rows),
        "curve": rewards,
    }


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def kept_runs() -> dict[tuple, dict]:
    """The summaries of the runs kept in KEPT whose measured code is unchanged since their commit, by (setup,
    max_staleness, correction, seed, steps)."""
    if not KEPT.is_file():
        return {}
    unchanged: dict[str, bool] = {}
    runs = {}
    for line in KEPT.read_text().splitlines():
        entry = json.loads(line)
        commit = entry["commit"]
        if commit not in unchanged:  # the working tree against the commit: uncommitted changes count too
            unchanged[commit] = git("diff", "--quiet", commit, "--", *MEASURED).returncode == 0
        if unchanged[commit]:
            runs[tuple(entry["run"])] = entry["summary"]
    return runs


def keep(key: tuple, summary: dict) -> None:
    KEPT.parent.mkdir(parents=True, exist_ok=True)
    commit = git("rev-parse", "HEAD").stdout.strip()
    with KEPT.open("a") as f:
        f.write(json.dumps({"run": list(key), "commit": commit, "summary": summary}) + "\n")


def median(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs]
    if key == "reached" and sum(v is None for v in values) * 2 > len(values):
        return None  # not reached in most runs
    return statistics.median(float("inf") if v is None else v for v in values)


def plot(cells: dict[tuple[str, int, str], list[dict]], path: Path) -> None:
    """The 20-step mean reward of each correction's first run, one panel per setup and max_staleness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(SETUPS), len(STALENESS), figsize=(11, 7), sharex=True, sharey=True)
    for row, setup in enumerate(SETUPS):
        for column, staleness in enumerate(STALENESS):
            axis = axes[row][column]
            for correction in CORRECTIONS:
                curve = cells[setup, staleness, correction][0]["curve"]
                smooth = [statistics.mean(curve[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(curve))]
                axis.plot(range(1, len(curve) + 1), smooth, label=correction)
            axis.set_title(f"{setup}, max_staleness {staleness}", fontsize=10)
            axis.grid(alpha=0.3)
    for axis in axes[-1]:
        axis.set_xlabel("step")
    for axis in axes[:, 0]:
        axis.set_ylabel(f"reward ({WINDOW}-step mean)")
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fresh", action="store_true", help="measure every run again, reusing none kept before")
    add_markdown_flag(parser)
    args = parser.parse_args()
    kept = {} if args.fresh else kept_runs()
    cells: dict[tuple[str, int, str], list[dict]] = {}
    for setup in SETUPS:
        for staleness in STALENESS:
            for correction in CORRECTIONS:
                runs = cells[setup, staleness, correction] = []
                for seed in range(args.runs):
                    key = (setup, staleness, correction, seed, args.steps)
                    reused = key in kept
                    if not reused:
                        kept[key] = summary(run(setup, correction, staleness, args.steps, seed))
                        keep(key, kept[key])
                    runs.append(last := kept[key])
                    print(
                        f"{setup}, max_staleness {staleness}, {correction}, run {seed + 1}/{args.runs}: reward "
                        f"{last['first']:.2f} -> {last['last']:.2f}, effective sample size {last['ess']:.4f}, "
                        f"mismatch KL {last['kl']:.2e}" + (" (kept from an earlier refresh)" if reused else ""),
                        flush=True,
                    )
    rows = []
    for (setup, staleness, correction), runs in cells.items():
        reached = median(runs, "reached")
        rows.append(
            [
                setup,
                str(staleness),
                correction,
                f"{median(runs, 'first'):.3f} -> {median(runs, 'last'):.3f}",
                "not reached" if reached is None else f"{reached:.0f} s",
                f"{median(runs, 'ess'):.4f}",
                f"{median(runs, 'kl'):.2e}",
            ]
        )
    header = ["setup", "max_staleness", "correction", "reward (first -> last 20 steps)", "time to 0.7"]
    table = markdown_table(header + ["effective sample size", "mismatch KL"], "lrlrrrr", rows)
    emit(table, args.markdown)
    if args.markdown:
        plot(cells, PLOT)


if __name__ == "__main__":
    main()
