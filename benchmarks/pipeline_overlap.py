"""Synchronous vs asynchronous: the same recipe, with generation and training taking turns or overlapping.

The generation server is `tandem serve` with a fixed delay after every decode step, standing in for a
GPU server, tuned so generation and training take comparable time. The synchronous run pauses the
server, and the clock of its step delay, while the trainer computes (generate, then train, then generate...); the asynchronous run is the
trainer as it is. Both train the same number of steps from the same weights; printed: both wall times,
the speed-up, and the ideal (G + T) / max(G, T) from the synchronous run's own G and T. Each row runs `--repeats`
pairs of runs (a single pair's ratio to the ideal moves by up to 0.2 on this 2-core machine) and shows the pair whose
ratio is the median, every figure from that pair. The reward is
the task's own integer check (math-verify would cost the worker CPU time the trainer then misses).
Each configuration (a server step delay and a max_staleness) is one row of the printed table, pinned by default
(`--cores`): the trainer alone on its cores, as on a device of its own, and the server with the rollout worker on
another (the server stands in for a GPU: it mostly sleeps); `--cores shared` has the three processes share the
machine's cores, `both` runs each row both ways. The last column is `tandem doctor`'s bottleneck for the
asynchronous run. `--train-delay-s` slows every optimizer step, standing in for a slower trainer (a trainer-bound run).
A row's staleness rule is the group's start version ("start") or, with `in_flight_weight_updates`, its tokens'
("tokens"); the stale column is the share of the asynchronous run's generated rollouts dropped or cancelled as stale.

    python benchmarks/pipeline_overlap.py [--steps 60] [--config STEP_DELAY_S MAX_STALENESS ...] [--in-flight]
                                          [--cores pinned|shared|both] [--train-delay-s S] [--weight-sync-steps N]
                                          [--max-num-seqs N] [--repeats 5] [--markdown PATH]
"""

import argparse
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from datasets import Dataset
from tables import add_markdown_flag, emit, markdown_table
from transformers import TrainerCallback

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
from tandem.generation.launcher import EmbeddedServer
from tandem.metrics import doctor
from tandem.tasks import TINY_MODEL_PATH, arithmetic

CONFIGS = [
    (0.05, 2, False),
    (0.02, 1, False),
    (0.05, 4, False),
    (0.15, 2, False),
    (0.05, 2, True),
    (0.05, 3, False),
    (0.02, 1, True),
    (0.02, 2, False),
]
"""(step delay in seconds, max_staleness, in_flight_weight_updates) of each row of the performance page's table: the
two tightest rows again with the staleness judged by the tokens, beside the start rule one version looser."""


class TakeTurns(TrainerCallback):
    """Generation and training take turns: the server is paused from the step's first forward until the step's
    weights are served (the step's end comes after its weight sync). The first step's sync is probed against this
    external server (sync_check.FORCED_PROBES; this exact fp32 server settles the probe there), which must score the
    probe: that step resumes at its optimizer step, and is left out of the measurement anyway."""

    def __init__(self, server_url: str):
        self.server_url = server_url

    def _post(self, path: str) -> None:
        urllib.request.urlopen(urllib.request.Request(self.server_url + path, method="POST"), timeout=60).close()

    def on_step_begin(self, args, state, control, **kwargs):
        self._post("/pause?mode=keep")

    def on_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == 0:  # the first step, not counted yet
            self._post("/resume")

    def on_step_end(self, args, state, control, **kwargs):
        self._post("/resume")


def slowed(trainer_cls, delay_s: float):
    """`trainer_cls` with `delay_s` of sleep in every optimizer step (a slower trainer); itself when 0."""
    if not delay_s:
        return trainer_cls

    class Slowed(trainer_cls):
        def optimizer_step(self):
            time.sleep(delay_s)
            return super().optimizer_step()

    return Slowed


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` to `cores`; threads and processes it starts later inherit them."""
    for thread in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(thread), cores)


class OwnCores(TrainerCallback):
    """The trainer alone on every core but `server_core`, as a trainer on its own device: the rollout worker it starts
    (while the run begins) shares `server_core` with the server (a stand-in for a GPU server: mostly its step delay)."""

    def __init__(self, server_core: int):
        self.server_core, self.every_core = server_core, os.sched_getaffinity(0)
        self.moved = False

    def on_train_begin(self, args, state, control, **kwargs):
        pin(os.getpid(), {self.server_core})  # the worker process started next inherits the server's core

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.moved:  # once, at the first step: the worker has started by then
            pin(os.getpid(), self.every_core - {self.server_core})
            self.moved = True


def run(
    trainer_cls,
    steps: int,
    delay: float,
    args_staleness: int,
    folder: Path,
    pinned: bool,
    sync_steps: int = 1,
    max_num_seqs: int = 256,
    take_turns: bool = False,
    in_flight: bool = False,
) -> dict:
    extra = [
        "--logprobs-mode",
        "processed_logprobs",
        "--served-model-name",
        TINY_MODEL_PATH,
        "--step-delay-s",
        str(delay),
        "--weight-transfer-config",
        '{"backend": "gloo"}',  # weights streamed, as to the trainer's own server
        "--max-num-seqs",
        str(max_num_seqs),
    ]
    # One CPU thread for the server: it stands in for a GPU, so its own compute should not take the trainer's cores.
    every_core = os.sched_getaffinity(0)
    with EmbeddedServer("tiny", extra_args=extra, env={"OMP_NUM_THREADS": "1"}) as server:
        callbacks = [TakeTurns(server.url)] if take_turns else []
        if pinned:  # the server and the rollout worker on the last core, the trainer on the others
            pin(server.process.pid, {max(every_core)})
            callbacks.append(OwnCores(max(every_core)))
        args = AsyncGRPOConfig(
            output_dir=str(folder),
            vllm_server_base_url=server.url,
            max_steps=steps,
            learning_rate=2e-4,
            num_generations=8,
            max_completion_length=8,
            token_budget=160,
            gradient_accumulation_steps=2,
            max_staleness=args_staleness,
            gradient_checkpointing=False,
            score_centering=False,
            save_strategy="no",
            weight_sync_steps=sync_steps,
            in_flight_weight_updates=in_flight,
        )
        data = Dataset.from_list(arithmetic.make_rows(128, split="train", seed=1))
        try:
            trainer_cls(
                "tiny", arithmetic.correctness_reward, args=args, train_dataset=data, callbacks=callbacks
            ).train()
        finally:
            pin(os.getpid(), every_core)
    rows = [json.loads(line) for line in open(folder / "metrics.jsonl")]
    # Measured from the end of the first step: the one-time start of the worker process is left out of both runs.
    wall = rows[-1]["time"] - rows[0]["time"]
    train = sum(r["perf/step_s"] - r["perf/rollout_wait_s"] for r in rows[1:])
    return {"wall": wall, "train": train, "wait": sum(r["perf/rollout_wait_s"] for r in rows[1:]), "stale": stale(rows)}


def stale(rows: list[dict]) -> float:
    """The share of a run's generated rollouts dropped as stale at the trainer or cancelled as stale in the worker (a
    cancelled group's rollouts count as generated: their tokens were)."""
    dropped = sum(r.get("sample/dropped_stale_count", 0) for r in rows)
    cancelled = sum(r.get("rollout/cancelled_stale_count", 0) for r in rows) * 8  # num_generations
    generated = sum(r.get("rollout/completions_count", 0) for r in rows) + cancelled
    return (dropped + cancelled) / max(generated, 1)


def bottleneck(folder: Path) -> str:
    """`tandem doctor`'s bottleneck for the whole run in `folder`."""
    rows, config = doctor.read_run(folder)
    finding = doctor.bottleneck(rows[1:], config)  # the first step includes the worker's start
    print(f"  doctor: {finding.line()}", flush=True)
    return finding.verdict


def compare(
    steps: int,
    delay: float,
    staleness: int,
    train_delay: float,
    pinned: bool,
    sync_steps: int,
    max_num_seqs: int,
    repeats: int,
    folder: Path,
    in_flight: bool = False,
) -> list[str]:
    """`repeats` pairs of runs of one configuration, synchronous then asynchronous; returns its row of the performance page's table:
    the pair whose speed-up over the ideal is the median (a row moved by up to 0.2 of the ideal between single pairs),
    every figure of the row from that pair, and the doctor's word on its asynchronous run."""
    pairs = []
    for repeat in range(repeats):
        sync = run(
            slowed(AsyncGRPOTrainer, train_delay),
            steps,
            delay,
            staleness,
            folder / f"sync-{repeat}",
            pinned,
            sync_steps,
            max_num_seqs,
            take_turns=True,
            in_flight=in_flight,
        )
        overlapped = run(
            slowed(AsyncGRPOTrainer, train_delay),
            steps,
            delay,
            staleness,
            folder / f"async-{repeat}",
            pinned,
            sync_steps,
            max_num_seqs,
            in_flight=in_flight,
        )
        train = sync["train"]
        generate = sync["wall"] - train
        ideal, speedup = ideal_speedup(generate, train), sync["wall"] / overlapped["wall"]
        pairs.append(
            {
                "generate": generate,
                "train": train,
                "sync": sync["wall"],
                "async": overlapped["wall"],
                "speedup": speedup,
                "ideal": ideal,
                "stale": overlapped["stale"],
                "folder": folder / f"async-{repeat}",
            }
        )
        print(
            f"  pair {repeat + 1}: synchronous {sync['wall']:.1f}s ({train:.1f}s training), asynchronous "
            f"{overlapped['wall']:.1f}s ({overlapped['wait']:.1f}s waiting for samples, {overlapped['stale']:.1%} "
            f"stale): {speedup / ideal:.2f} of the ideal",
            flush=True,
        )
    pair = sorted(pairs, key=lambda p: p["speedup"] / p["ideal"])[len(pairs) // 2]
    slower = (
        (f", trainer +{train_delay:g} s" if train_delay else "")
        + (f", sync every {sync_steps}" if sync_steps > 1 else "")
        + (f", {max_num_seqs} seqs" if max_num_seqs != 256 else "")
    )
    return [
        f"{delay:g} s, {staleness}{slower}",
        "tokens" if in_flight else "start",
        "pinned" if pinned else "shared",
        f"{pair['generate']:.1f}",
        f"{pair['train']:.1f}",
        f"{pair['sync']:.1f}",
        f"{pair['async']:.1f}",
        f"{pair['speedup']:.2f}x",
        f"{pair['ideal']:.2f}x",
        f"{pair['speedup'] / pair['ideal']:.2f}",
        f"{pair['stale']:.1%}",
        bottleneck(pair["folder"]),
    ]


def ideal_speedup(generate: float, train: float) -> float:
    """(G + T) / max(G, T): generation and training overlapped perfectly."""
    return (generate + train) / max(generate, train)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--config",
        nargs=2,
        action="append",
        metavar=("STEP_DELAY_S", "MAX_STALENESS"),
        help="one row: the server's sleep after every decode step, and how far generation may run ahead "
        "(with slow rollouts it must cover their latency); repeatable. Default: the performance page's rows, "
        + ", ".join(f"{d} {s}{' (in-flight)' if f else ''}" for d, s, f in CONFIGS),
    )
    parser.add_argument(
        "--in-flight",
        action="store_true",
        help="with --config: judge staleness by the tokens (in_flight_weight_updates) in those rows",
    )
    parser.add_argument(
        "--cores",
        choices=["shared", "pinned", "both"],
        default="pinned",
        help="pinned (default): the trainer alone on its cores, the server and the rollout worker on another "
        "(separate devices, as on GPUs); shared: the three processes share every core; both: each row both ways",
    )
    parser.add_argument(
        "--train-delay-s",
        type=float,
        default=0.0,
        help="sleep this long in every optimizer step, standing in for a slower trainer (default 0)",
    )
    parser.add_argument("--weight-sync-steps", type=int, default=1, help="steps between weight syncs (default 1)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="pairs of runs of each row, an odd number; the table shows the pair of median ratio to the ideal "
        "(default 5)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="the server's batch limit (default 256); a small one makes a server at capacity",
    )
    add_markdown_flag(parser)
    args = parser.parse_args()
    if args.repeats < 1 or args.repeats % 2 == 0:
        parser.error(f"--repeats {args.repeats}: give an odd number (1, 3, 5), so that the median is one pair's")
    configs = [(float(d), int(s), args.in_flight) for d, s in args.config] if args.config else CONFIGS
    modes = {"shared": [False], "pinned": [True], "both": [False, True]}[args.cores]
    if True in modes and len(os.sched_getaffinity(0)) < 2:
        parser.error("--cores pinned needs at least 2 cores: the server on one, the trainer on the others")
    # On a CPU-only machine the server, the worker and the trainer share the cores. A trainer that spreads
    # one matmul over every core stalls whenever another process runs; one thread each keeps them apart.
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (delay, staleness, in_flight) in enumerate(configs):
            for pinned in modes:
                print(
                    f"step delay {delay} s, max_staleness {staleness}{', in-flight' if in_flight else ''}, "
                    f"{args.steps} steps, {'pinned' if pinned else 'shared'} cores",
                    flush=True,
                )
                rows.append(
                    compare(
                        args.steps,
                        delay,
                        staleness,
                        args.train_delay_s,
                        pinned,
                        args.weight_sync_steps,
                        args.max_num_seqs,
                        args.repeats,
                        Path(tmp) / f"{i}-{pinned}",
                        in_flight,
                    )
                )
    emit(
        markdown_table(
            [
                "step delay, max_staleness",
                "judged by",
                "cores",
                "G (s)",
                "T (s)",
                "synchronous (s)",
                "asynchronous (s)",
                "speed-up",
                "ideal (G+T)/max(G,T)",
                "speed-up / ideal",
                "stale",
                "doctor (asynchronous run)",
            ],
            "rllrrrrrrrrl",
            rows,
        ),
        args.markdown,
    )


if __name__ == "__main__":
    main()
