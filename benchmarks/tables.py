"""The performance page's table of a benchmark: printed with its other output and, with `--markdown PATH`, written to PATH.

refresh.py runs each benchmark with `--markdown` and pastes that file into README.md, so what a script
prints is exactly what docs/performance.md shows.
"""

import argparse
from pathlib import Path


def add_markdown_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--markdown", metavar="PATH", help="also write the performance page's table to PATH (used by refresh.py)"
    )


def markdown_table(header: list[str], align: str, rows: list[list[str]]) -> str:
    """A markdown table; `align` has one letter per column, `l` (text) or `r` (numbers)."""
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|\n"
    lines = [f"| {' | '.join(cells)} |\n" for cells in [header, *rows]]
    return lines[0] + rule + "".join(lines[1:])


def emit(table: str, path: str | None) -> None:
    """Print the table, and write it to `path` when one was given."""
    print("\n" + table, end="", flush=True)
    if path:
        Path(path).write_text(table)
