"""Re-run the benchmarks behind the performance page's tables (docs/performance.md) and rewrite them in place.

Each table sits between `<!-- bench:NAME -->` and `<!-- /bench -->` in docs/performance.md, where NAME is a script
in this folder; README.md repeats the headline table (vs_trl) in a block of its own, rewritten with it. The script
runs at its default (full) sizes in its own process, its output shown as it comes, and writes its table with
`--markdown PATH`; this one pastes the table in, followed by a line naming the commit it was measured at (marked when
the work tree had uncommitted changes) and the date. The pages are rewritten after each benchmark. A benchmark that
fails leaves its table as it was, the others still run,
and this script then exits non-zero.

    python benchmarks/refresh.py [NAME ...]     (every benchmark when none is named)
"""

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PAGE = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
BENCHMARKS = {  # in the page's order, with about how long each takes on the project's quiet 2-core machine
    "vs_trl": "~15 min",
    "pipeline_overlap": "~40 min",
    "mismatch": "~2.5 h",
    "kv_cache_at_sync": "~5 min",
    "packing": "~4 min",
    "packing_76m": "~9 min",
    "logprob_memory": "~2 min",
    "proxy": "~10 s",
    "weight_sync": "~2 min",
    "fsdp": "~2 min",
    "serve_throughput": "~4 min",
    "serve_throughput_76m": "~12 min",
    "multiturn": "~30 s",
    "soak": "~30 min",
}


def replace_table(text: str, name: str, table: str, stamp: str) -> str:
    """`text` with the block marked for `name` now holding `table` and `stamp`; raises unless there is exactly one."""
    pattern = re.compile(rf"(<!-- bench:{re.escape(name)} -->\n).*?(<!-- /bench -->)", re.DOTALL)
    found = len(pattern.findall(text))
    if found != 1:
        raise ValueError(f"expected one <!-- bench:{name} --> ... <!-- /bench --> block, found {found}")
    return pattern.sub(lambda match: f"{match[1]}{table}\n{stamp}\n{match[2]}", text)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def measured_at() -> str:
    """The line under each table: the commit, whether the tree differed from it, and today's date. The pages with
    tables are left out of the comparison: rewriting them changes nothing measured."""
    dirty = (
        " (uncommitted changes)"
        if git("status", "--porcelain", "--", ".", ":(exclude)README.md", ":(exclude)docs/performance.md")
        else ""
    )
    return f"Measured at commit `{git('rev-parse', '--short', 'HEAD')}`{dirty} on {datetime.date.today().isoformat()}."


def run_benchmark(name: str, table_path: Path) -> bool:
    """Run benchmarks/NAME.py at its default sizes; True when it exited 0 and wrote its table."""
    start = time.perf_counter()
    command = [sys.executable, str(HERE / f"{name}.py"), "--markdown", str(table_path)]
    code = subprocess.run(command, cwd=ROOT).returncode
    ok = code == 0 and table_path.is_file() and table_path.read_text().strip() != ""
    seconds = round(time.perf_counter() - start)
    outcome = "done" if ok else f"FAILED (exit code {code}; its table is left as it was)"
    print(f"== {name}: {outcome} after {seconds // 60}m{seconds % 60:02d}s", flush=True)
    return ok


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="benchmarks: " + ", ".join(f"{name} ({duration})" for name, duration in BENCHMARKS.items()),
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to re-run (default: all)")
    parser.add_argument(
        "--page",
        type=Path,
        default=PAGE,
        help="the page whose tables are rewritten (default docs/performance.md; README.md's copies follow)",
    )
    args = parser.parse_args()
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    args.names = args.names or list(BENCHMARKS)
    return args


def main() -> int:
    args = parse_args()
    stamp = measured_at()  # before the first rewrite, which itself makes the tree differ
    copies = [README] if args.page == PAGE else []  # the README repeats tables of the project's own page only
    for name in args.names:  # every block exists (and the README's copies are single) before anything runs for minutes
        replace_table(args.page.read_text(), name, "", stamp)
        for page in copies:
            if f"<!-- bench:{name} -->" in page.read_text():
                replace_table(page.read_text(), name, "", stamp)
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.names, 1):
            print(f"== [{i}/{len(args.names)}] {name} ({BENCHMARKS[name]})", flush=True)
            table_path = Path(tmp) / f"{name}.md"
            if not run_benchmark(name, table_path):
                failed.append(name)
                continue
            for page in [args.page] + [page for page in copies if f"<!-- bench:{name} -->" in page.read_text()]:
                page.write_text(replace_table(page.read_text(), name, table_path.read_text(), stamp))
    print(
        f"== {args.page}: {len(args.names) - len(failed)} table(s) rewritten"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
