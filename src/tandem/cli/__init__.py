"""The `tandem` command line: `tandem train RECIPE.yaml [--field value ...] [--dry-run]`, `tandem serve MODEL`,
`tandem proxy --upstream URL [--upstream URL ...]`, `tandem doctor | report RUN_DIR`,
`tandem export RUN_DIR/checkpoint-N`, `tandem env` and `tandem --version`.

A user's mistake is one line on stderr and exit code 2 on every command (exit 1 is `tandem doctor`'s critical
finding); a warning is one `tandem <command>: warning: ...` line."""

import argparse
import os

from tandem.cli.proxy import proxy_parser, run_proxy
from tandem.cli.runs import export_parser, run_doctor, run_export, run_report
from tandem.cli.serve import run_serve, serve_parser, vllm_flags_taken
from tandem.cli.train import run_train, train_parser
from tandem.errors import warnings_as_lines

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """Every command and its flags (the command-line reference page is generated from this)."""
    from tandem import DISTRIBUTION, __version__

    parser = argparse.ArgumentParser(prog="tandem", description="Asynchronous RL for language models.")
    parser.add_argument("--version", action="version", version=f"tandem {__version__} ({DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser(sub)
    serve_parser(sub)
    proxy_parser(sub)
    doctor = sub.add_parser(
        "doctor",
        help="diagnose a run from its metrics.jsonl: bottleneck, learning and sync health",
        description="Read RUN_DIR/metrics.jsonl and say, for the last window and the whole run, what "
        "limits it, whether it learns and whether its syncs hold, with the numbers and the "
        "knob to turn. Exits 1 on a critical finding (the run is not learning or not valid).",
    )
    doctor.add_argument("run_dir", help="a run's output_dir")
    report = sub.add_parser(
        "report",
        help="plot a run's metrics.jsonl into RUN_DIR/report.html, with the doctor's findings",
        description="Draw RUN_DIR/metrics.jsonl (reward, importance ratio, step time split, queue, "
        "waits, staleness, concurrency, KV cache, packing, throughput, tools) into a "
        "self-contained RUN_DIR/report.html and PNGs in RUN_DIR/report/. Every run writes "
        "it when it ends; this redraws it, also while a run is going.",
    )
    report.add_argument("run_dir", help="a run's output_dir")
    export_parser(sub)
    sub.add_parser(
        "env",
        help="the versions and hardware a bug report needs, to paste into it",
        description="Print tandem's, Python's, torch's (its CUDA or CPU build, the GPUs seen), transformers', "
        "peft's, datasets' and vLLM's versions, the platform and the CPU.",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    ns, rest = parser.parse_known_args(argv)
    warnings_as_lines(ns.command)
    if ns.command == "train":
        # Trainer, rollout worker and embedded server share the machine's cores. OpenMP threads that spin while
        # idle steal them from each other (a training step ran 20x slower on two cores); passive waiting costs
        # nothing measurable there. It must be set before anything imports torch, and subprocesses inherit it.
        # `tandem serve` alone keeps OpenMP's default (spin briefly, then sleep): passive waiting halves its
        # tokens/s on a CPU (benchmarks/serve_throughput.py).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        run_train(ns, rest)
    elif ns.command == "serve":
        run_serve(vllm_flags_taken(ns, rest, parser))
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    elif ns.command == "proxy":
        run_proxy(ns)
    elif ns.command == "doctor":
        run_doctor(ns)
    elif ns.command == "report":
        run_report(ns)
    elif ns.command == "export":
        run_export(ns)
    elif ns.command == "env":
        from tandem.system_info import report as environment

        print(environment())
