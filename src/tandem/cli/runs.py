"""The commands that read a run's folder: `tandem doctor`, `tandem report` and `tandem export`."""

import argparse
import sys

from tandem.cli.user_input import user_error
from tandem.errors import UsageError


def run_doctor(ns: argparse.Namespace) -> None:
    from pathlib import Path

    from tandem.metrics.doctor import report

    try:
        text, critical = report(Path(ns.run_dir))
    except (FileNotFoundError, ValueError) as exc:  # exit 2: a wrong path, a broken file; exit 1: a critical finding
        user_error(f"tandem doctor: {exc}")
    print(text)
    if critical:
        sys.exit(1)


def run_report(ns: argparse.Namespace) -> None:
    from pathlib import Path

    from tandem.metrics import report

    try:
        path = report.write(Path(ns.run_dir))
    except (FileNotFoundError, ValueError) as exc:
        user_error(f"tandem report: {exc}")
    print(f"wrote {path} (plots also in {path.parent / 'report'})")


def export_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="a checkpoint as one model folder vllm serve, transformers and tandem serve load",
        description="Write RUN_DIR/checkpoint-N as one Hugging Face model folder (safetensors, config, "
        "generation config, tokenizer) that loads without peft: a LoRA checkpoint's adapter "
        "merged into its base model, a full-weight checkpoint's model without the training "
        "state. torchrun checkpoints too (their model folder is saved whole).",
    )
    p.add_argument("checkpoint", help="a run's checkpoint-N folder")
    p.add_argument(
        "--output", default=None, metavar="DIR", help="the folder to write (default: checkpoint-N-merged beside it)"
    )
    p.add_argument("--force", action="store_true", help="replace --output when it exists and is not empty")
    p.add_argument(
        "--base-model",
        default=None,
        metavar="PATH",
        help="the base model a LoRA adapter merges into (default: the one the checkpoint records; 'tiny' "
        "is the built-in model)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the weights' dtype (default auto: the base model's, or the checkpoint's for full weights)",
    )


def run_export(ns: argparse.Namespace) -> None:
    from pathlib import Path

    from tandem.trainer.export import export

    try:
        folder = export(
            Path(ns.checkpoint),
            Path(ns.output) if ns.output else None,
            base_model=ns.base_model,
            dtype=ns.dtype,
            force=ns.force,
        )
    except (FileNotFoundError, FileExistsError, UsageError) as exc:
        user_error(f"tandem export: {exc}")
    print(f"tandem export: wrote {folder}")
