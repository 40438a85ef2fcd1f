"""In-flight weight updates on `tandem serve`: the running sequences' cache kept at a sync, or computed again.

Under `in_flight_weight_updates` generation goes on across weight syncs. `tandem serve` then either keeps the keys and
values the older weights computed for its running sequences (the default: their later tokens come from new weights
over an old cache, a distribution no trainer version reproduces, counted in `sample/mixed_tokens_frac`) or computes
them again under the new weights (`recompute_kv_cache_after_weight_updates`: each token is exactly one version's, at
the cost of a prefill of every running sequence per sync).

Each way runs the demo (`examples/demo.yaml`: the embedded server, float32, so trainer and server agree bit for bit
and the only mismatch is the kept cache's) with `in_flight_weight_updates` at `--max-staleness`, `--runs` times
(seeds 0, 1, ...). Printed per way, the median over the runs of: the server's generated tokens per second
(`rollout/generated_tokens_per_s`), the share of trained tokens generated over a cache of older weights, the effective
sample size and mismatch KL (`sampling/*`), the reward of the last 20 steps, and the wall time.

    python benchmarks/kv_cache_at_sync.py [--runs 3] [--steps 150] [--max-staleness 1] [--markdown PATH]
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
WAYS = {"kept": "false", "recomputed": "true"}


def run(recompute: str, staleness: int, steps: int, seed: int) -> dict:
    """One `tandem train examples/demo.yaml` in-flight; the means of its logged figures."""
    flags = ["--in_flight_weight_updates", "true", "--recompute_kv_cache_after_weight_updates", recompute]
    flags += ["--max_staleness", str(staleness), "--max_steps", str(steps), "--seed", str(seed)]
    flags += ["--disable_tqdm", "true", "--save_strategy", "no"]
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "tandem", "train", "examples/demo.yaml", "--output_dir", out, *flags]
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        logged = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [m for m in logged if "reward" in m and "batch/samples_per_step" in m]

    def mean(name: str) -> float:
        return statistics.mean(m[name] for m in logged if name in m)

    return {
        "tokens_per_s": mean("rollout/generated_tokens_per_s"),
        "mixed": mean("sample/mixed_tokens_frac"),
        "ess": mean("sampling/effective_sample_size"),
        "kl": mean("sampling/mismatch_kl"),
        "last": statistics.mean(m["reward"] for m in steps_logged[-20:]),
        "wall": steps_logged[-1]["time"] - (steps_logged[0]["time"] - steps_logged[0]["perf/step_s"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--max-staleness", type=int, default=1)
    add_markdown_flag(parser)
    args = parser.parse_args()
    rows = []
    for way, recompute in WAYS.items():
        runs = []
        for seed in range(args.runs):
            runs.append(run(recompute, args.max_staleness, args.steps, seed))
            figures = runs[-1]
            print(
                f"cache {way}, run {seed + 1}/{args.runs}: {figures['tokens_per_s']:.0f} tokens/s, "
                f"{figures['mixed']:.2%} mixed, effective sample size {figures['ess']:.4f}, "
                f"mismatch KL {figures['kl']:.2e}, reward (last 20) {figures['last']:.3f}, {figures['wall']:.0f} s",
                flush=True,
            )
        middle = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        rows.append(
            [
                way,
                f"{middle['tokens_per_s']:.0f}",
                f"{middle['mixed']:.2%}",
                f"{middle['ess']:.4f}",
                f"{middle['kl']:.2e}",
                f"{middle['last']:.3f}",
                f"{middle['wall']:.0f}",
            ]
        )
    header = ["cache at a sync", "generated tokens/s", "mixed tokens", "effective sample size", "mismatch KL"]
    table = markdown_table(header + ["reward (last 20 steps)", "wall (s)"], "lrrrrrr", rows)
    emit(table, args.markdown)


if __name__ == "__main__":
    main()
