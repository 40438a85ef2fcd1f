"""Soak: the demo recipe trained for `--minutes` (30) with its embedded server killed (`kill -9`) every `--kill-every`
minutes (5), as a crashing server would be. The trainer runs in this process, so what it leaves behind is measured
directly. Reported:

- prompt positions finished, against those the run's watermark says it covered: each exactly once (none twice,
  none missing), across every restart;
- processes, threads and file descriptors left after `train()` returns, against before it started (goal: none; the
  trainer object is still alive then, so its open transfer group to the last server counts), and the open file
  descriptors at each kill (a leak grows with the restarts);
- resident memory of the trainer's process at the first kill (warm) and at the end;
- server restarts, steps, and the reward of the first and last 20 steps.

    python benchmarks/soak.py [--minutes 30] [--kill-every 5] [--markdown PATH]

The embedded server is restarted at most 3 times in 10 minutes (more stops the run): keep --kill-every above 3.5
minutes for long soaks.
"""

import argparse
import gc
import os
import signal
import tempfile
import threading
import time
from collections import Counter
from multiprocessing import resource_tracker
from pathlib import Path

import psutil
from tables import add_markdown_flag, emit, markdown_table
from transformers import TrainerCallback

from tandem import AsyncGRPOTrainer
from tandem.recipe import import_object, load_recipe
from tandem.runtime.session import Session
from tandem.tasks import datasets

RECIPE = Path(__file__).resolve().parent.parent / "examples" / "demo.yaml"


def resources() -> dict[str, Counter]:
    """This process's live children (by command line), threads (by name) and open file descriptors (by what they
    point to: a pipe, a socket, a path)."""
    me = psutil.Process()
    children = [c for c in me.children(recursive=True) if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    fds = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[os.readlink(f"/proc/self/fd/{fd}").split(":[")[0]] += 1
        except OSError:  # the descriptor listdir itself used
            pass
    return {
        "processes": Counter(" ".join(c.cmdline()[:4]) for c in children),
        "threads": Counter(t.name.split("-")[0] for t in threading.enumerate()),
        "fds": fds,
    }


def left_behind(before: dict[str, Counter], after: dict[str, Counter]) -> dict[str, Counter]:
    return {name: after[name] - before[name] for name in before}


class KillServer(TrainerCallback):
    """Kills the embedded server every `every_s` seconds (at a step's end: the worker has requests in flight) and ends
    the run after `total_s`; keeps the trainer's resident memory at each kill."""

    def __init__(self, trainer: AsyncGRPOTrainer, total_s: float, every_s: float):
        self.trainer, self.total_s, self.every_s = trainer, total_s, every_s
        self.start = self.next_kill = None
        self.kills: list[int] = []
        self.rss_mb: list[float] = []
        self.fds: list[int] = []
        """Open file descriptors of this process at each kill: a leak grows with the restarts."""

    def on_step_end(self, args, state, control, **kwargs):
        now = time.monotonic()
        if self.start is None:
            self.start, self.next_kill = now, now + self.every_s
        if now - self.start >= self.total_s:
            control.should_training_stop = True
        elif now >= self.next_kill:
            server = self.trainer.runtime.session.server
            os.kill(server.process.pid, signal.SIGKILL)
            self.kills.append(state.global_step)
            self.rss_mb.append(psutil.Process().memory_info().rss / 2**20)
            self.fds.append(psutil.Process().num_fds())
            self.next_kill += self.every_s
            print(
                f"soak: {(now - self.start) / 60:.1f} min, step {state.global_step}: killed the server (pid "
                f"{server.process.pid}), resident memory {self.rss_mb[-1]:.0f} MiB, {self.fds[-1]} open files",
                flush=True,
            )
        return control


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--kill-every", type=float, default=5.0, help="minutes between two kills of the server")
    add_markdown_flag(parser)
    ns = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(str(RECIPE), ["--max_steps", "1000000", "--save_steps", "500", "--output_dir", tmp])
        trainer = AsyncGRPOTrainer(
            recipe.model,
            [import_object(f) for f in recipe.reward_funcs],
            args=recipe.config,
            train_dataset=datasets.load(recipe.dataset),
        )
        killer = KillServer(trainer, ns.minutes * 60, ns.kill_every * 60)
        trainer.add_callback(killer)
        Session.write_report = lambda session: None  # matplotlib keeps its fonts open for the interpreter's life
        resource_tracker.ensure_running()  # multiprocessing's one helper process per interpreter, started at the first spawn
        before = resources()
        started = time.monotonic()
        trainer.train()
        elapsed = time.monotonic() - started
        time.sleep(2)  # processes stopped at the end finish exiting
        gc.collect()  # what the run dropped (the transfer groups of servers that died) is released
        after = resources()
        end_rss = psutil.Process().memory_info().rss / 2**20
        ledger = trainer.runtime.source.ledger
        restarts = sum(row.get("rollout/server_restart_count", 0) for row in trainer.state.log_history)

    counts = Counter(ledger.finished)
    twice = sum(1 for n in counts.values() if n > 1)
    missing = len(set(range(ledger.watermark)) - set(counts))
    history = trainer.reward_history
    warm = killer.rss_mb[0] if killer.rss_mb else end_rss
    leaked = left_behind(before, after)
    leaks = {name: sum(found.values()) for name, found in leaked.items()}
    print(
        f"\nsoak: {elapsed / 60:.1f} min, {trainer.state.step} steps, server killed {len(killer.kills)} times "
        f"(steps {killer.kills}), restarted {restarts:.0f} times"
    )
    print(f"prompt positions: {len(counts)} finished, watermark {ledger.watermark}; {twice} twice, {missing} missing")
    print(
        f"left behind: {leaks['processes']} processes, {leaks['threads']} threads, {leaks['fds']} file descriptors: "
        f"{ {name: dict(found) for name, found in leaked.items() if found} }"
    )
    print(
        f"resident memory: {warm:.0f} MiB at the first kill, {end_rss:.0f} MiB at the end ({end_rss - warm:+.0f} MiB); "
        f"open files at each kill: {killer.fds}"
    )
    rows = [
        [
            f"{elapsed / 60:.0f}",
            str(len(killer.kills)),
            f"{restarts:.0f}",
            str(trainer.state.step),
            f"{len(counts)} of {max(ledger.watermark, len(counts))}",
            str(twice),
            str(missing),
            f"{leaks['processes']} / {leaks['threads']} / {leaks['fds']}",
            f"{killer.fds[0]} → {killer.fds[-1]}" if killer.fds else "-",
            f"{warm:.0f} → {end_rss:.0f}",
            f"{sum(history[:20]) / max(1, len(history[:20])):.2f} → {sum(history[-20:]) / max(1, len(history[-20:])):.2f}",
        ]
    ]
    emit(
        markdown_table(
            [
                "minutes",
                "server kills",
                "restarts",
                "steps",
                "prompts finished",
                "twice",
                "missing",
                "left after train(): processes / threads / fds",
                "open fds (first → last kill)",
                "trainer RSS MiB (first kill → end)",
                "reward",
            ],
            "rrrrrrrrrrr",
            rows,
        ),
        ns.markdown,
    )


if __name__ == "__main__":
    main()
