"""What every command shares: a user's mistake as one line and exit code 2, and the parsers of values the
user writes (flag values, the recipe's `lora:` mapping), each error naming the value and the fix."""

import argparse
import json
import sys
import typing

from tandem.errors import UsageError


def user_error(message: str) -> typing.NoReturn:
    """A mistake in what the user gave: one line on stderr and exit code 2 (as argparse does), no traceback."""
    print(message, file=sys.stderr)
    sys.exit(2)


def listen_options(p: argparse.ArgumentParser) -> None:
    """--host and --port of a server command (tandem serve, tandem proxy)."""
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default 127.0.0.1: this machine only; 0.0.0.0, or one of this machine's addresses, for "
        "trainers and proxies on other machines)",
    )
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default 8000)")


def switch(p: argparse.ArgumentParser, name: str, help: str, default: bool = False) -> None:
    """`--NAME` and vLLM 0.33's spellings of its opposite, `--no-NAME` and `--disable-X` for `--enable-X` (hidden)."""
    dest = name.replace("-", "_")
    p.add_argument(f"--{name}", dest=dest, action="store_true", default=default, help=help)
    opposites = [f"--no-{name}"] + ([f"--disable-{name.removeprefix('enable-')}"] if name.startswith("enable-") else [])
    p.add_argument(*opposites, dest=dest, action="store_false", help=argparse.SUPPRESS)


def json_object(text: str) -> dict:
    """A flag's JSON object value ('{"key": value}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not JSON ({exc.msg}): write an object, e.g. '{{\"key\": 1}}'"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object: write one, e.g. '{{\"key\": 1}}'")
    return value


def lora_module(text: str) -> dict:
    """One `--lora-modules` item as vLLM reads it: name=path, or a JSON object with name and path."""
    if "=" in text and "," not in text:  # name=path
        name, _, path = text.partition("=")
        return {"name": name, "path": path}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"Invalid JSON format for --lora-modules: {text}") from None
    if not (
        isinstance(value, dict)
        and {"name", "path"} <= set(value) <= {"name", "path", "base_model_name", "is_3d_lora_weight"}
    ):
        raise argparse.ArgumentTypeError(
            f'Invalid fields for --lora-modules: {text} - write name=path or {{"name": ..., "path": ...}}'
        )
    if value.get("is_3d_lora_weight"):
        raise argparse.ArgumentTypeError(
            f"--lora-modules {text}: is_3d_lora_weight is not supported: tandem serve loads PEFT's 2D LoRA layout"
        )
    return {"name": value["name"], "path": value["path"]}


def lora_config(fields: dict):
    """The recipe's `lora:` mapping as a peft.LoraConfig, its own error naming a field it does not have."""
    from peft import LoraConfig

    try:
        return LoraConfig(**fields)
    except (TypeError, ValueError) as exc:  # a field it does not have; a value it refuses
        raise UsageError(
            f"lora: {exc}. Use peft.LoraConfig fields (r, lora_alpha, lora_dropout, target_modules, ...)"
        ) from None
