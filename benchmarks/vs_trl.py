"""tandem against TRL's synchronous GRPOTrainer on the demo's task, one after the other, as a new user would compare them.

Both train the tiny model on `arithmetic-small` with `accuracy_reward`, 8 generations of at most 8 tokens, learning
rate 2e-4 constant, 300 steps, fp32 on the CPU. TRL 1.16 (`pip install trl==1.16.0`, a benchmark-only dependency):
beta 0, 32 completions a micro-batch x 2 accumulation = 64 completions a step, `use_cpu`, generation in-process
(`generate()`), nothing overlapped. tandem: `tandem train examples/demo.yaml` as shipped (async, exact decoding, the
exact tree kernel). Each run is a process of its own; the table gives medians over `--runs` runs of each.

Counted from the start of training (model and server start-up left out): trained samples/s (tandem drops groups
without reward variance, TRL trains them: both counts shown), completions generated/s and prompts/s, seconds per step,
the reward (mean over all completions scored) of the first and last 20 steps, and the time until the mean reward of
the last 20 steps first reaches 0.6 / 0.7 / 0.8.

    python benchmarks/vs_trl.py [--runs 3] [--steps 300] [--markdown PATH]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tables import add_markdown_flag, emit, markdown_table

ROOT = Path(__file__).resolve().parent.parent
THRESHOLDS = (0.6, 0.7, 0.8)
WINDOW = 20


def trl_run(steps: int, seed: int) -> list[dict]:
    """TRL's GRPOTrainer on the demo's task; per step: seconds since training began, reward, trained, generated."""
    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        sys.exit("benchmarks/vs_trl.py needs TRL: pip install trl==1.16.0")
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from tandem.rewards import accuracy_reward
    from tandem.tasks import TINY_MODEL_PATH, datasets

    class Clock(TrainerCallback):
        def __init__(self):
            self.start, self.rows = None, []

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rows.append(
                    {"s": time.perf_counter() - self.start, "reward": logs["reward"], "trained": 64, "generated": 64}
                )

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=32,
        gradient_accumulation_steps=2,
        num_generations=8,
        max_completion_length=8,
        learning_rate=2e-4,
        lr_scheduler_type="constant",
        beta=0.0,
        use_cpu=True,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=seed,
        disable_tqdm=True,
        gradient_checkpointing=False,
    )  # as the demo: off
    clock = Clock()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH),
        reward_funcs=accuracy_reward,
        args=args,
        train_dataset=datasets.load("arithmetic-small"),
        processing_class=AutoTokenizer.from_pretrained(TINY_MODEL_PATH),
        callbacks=[clock],
    )
    trainer.train()
    return clock.rows


def tandem_run(steps: int, seed: int) -> list[dict]:
    """`tandem train examples/demo.yaml`; per step: seconds since its first step began, reward, trained, generated."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tandem",
                "train",
                "examples/demo.yaml",
                "--output_dir",
                out,
                "--max_steps",
                str(steps),
                "--seed",
                str(seed),
                "--disable_tqdm",
                "true",
            ],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        logged = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in logged if "reward" in m and "batch/samples_per_step" in m]
    start = logged[0]["time"] - logged[0]["perf/step_s"]
    return [
        {
            "s": m["time"] - start,
            "reward": m["reward"],
            "trained": m["batch/samples_per_step"],
            "generated": m.get("rollout/completions_count", 0.0),
        }
        for m in logged
    ]


def summary(rows: list[dict]) -> dict:
    """One run's figures (times in seconds; None for a reward never reached)."""
    total = rows[-1]["s"]
    rewards = [r["reward"] for r in rows]
    reached = {}
    for threshold in THRESHOLDS:
        reached[threshold] = next(
            (
                rows[i]["s"]
                for i in range(WINDOW - 1, len(rows))
                if statistics.mean(rewards[i - WINDOW + 1 : i + 1]) >= threshold
            ),
            None,
        )
    return {
        "seconds": total,
        "step_s": total / len(rows),
        "trained_per_s": sum(r["trained"] for r in rows) / total,
        "generated_per_s": sum(r["generated"] for r in rows) / total,
        "first": statistics.mean(rewards[:WINDOW]),
        "last": statistics.mean(rewards[-WINDOW:]),
        "reached": reached,
    }


def median_of(runs: list[dict], key, threshold=None) -> float | None:
    values = [run[key] if threshold is None else run[key][threshold] for run in runs]
    if threshold is not None and sum(v is None for v in values) * 2 > len(values):
        return None  # not reached in most runs
    return statistics.median(v if v is not None else float("inf") for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    add_markdown_flag(parser)
    parser.add_argument("--side", choices=["trl", "tandem"], help=argparse.SUPPRESS)  # one run, in a child
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        rows = (trl_run if args.side == "trl" else tandem_run)(args.steps, args.seed)
        print(json.dumps(rows))
        return

    results = {"tandem": [], "trl": []}
    for run in range(args.runs):
        for side in results:
            child = subprocess.run(
                [sys.executable, __file__, "--side", side, "--seed", str(run), "--steps", str(args.steps)],
                capture_output=True,
                text=True,
            )
            if child.returncode != 0:
                sys.exit(f"the {side} run failed:\n{child.stderr[-3000:]}")
            figures = summary(json.loads(child.stdout.strip().splitlines()[-1]))
            results[side].append(figures)
            print(
                f"run {run + 1}/{args.runs} {side:>6}: {figures['seconds']:.0f} s, {figures['trained_per_s']:.0f} trained "
                f"samples/s, reward {figures['first']:.2f} -> {figures['last']:.2f}",
                flush=True,
            )

    def cell(value, unit="", digits=0):
        return "not reached" if value is None else f"{value:.{digits}f}{unit}"

    rows = []
    for side, name in (("tandem", "tandem (examples/demo.yaml)"), ("trl", "TRL GRPOTrainer (sync)")):
        runs = results[side]
        generated = median_of(runs, "generated_per_s")
        rows.append(
            [
                name,
                cell(median_of(runs, "seconds"), " s"),
                cell(median_of(runs, "step_s"), " s", 2),
                cell(median_of(runs, "trained_per_s")),
                cell(generated),
                cell(generated / 8),
                f"{median_of(runs, 'first'):.2f} → {median_of(runs, 'last'):.2f}",
                " / ".join(cell(median_of(runs, "reached", t), " s") for t in THRESHOLDS),
            ]
        )
    ours, theirs = results["tandem"], results["trl"]
    speed = median_of(ours, "trained_per_s") / median_of(theirs, "trained_per_s")
    to_07 = [median_of(side, "reached", 0.7) for side in (ours, theirs)]
    ratio_07 = f"{to_07[0] / to_07[1]:.2f}x" if None not in to_07 else "n/a"
    rows.append(["tandem / TRL", "", "", f"{speed:.2f}x", "", "", "", f"time to 0.7: {ratio_07}"])
    emit(
        markdown_table(
            [
                "trainer",
                f"{args.steps} steps",
                "per step",
                "trained samples/s",
                "completions generated/s",
                "prompts/s",
                f"reward, first → last {WINDOW} steps",
                f"time to a {WINDOW}-step mean reward of " + " / ".join(map(str, THRESHOLDS)),
            ],
            "lrrrrrrr",
            rows,
        ),
        args.markdown,
    )


if __name__ == "__main__":
    main()
