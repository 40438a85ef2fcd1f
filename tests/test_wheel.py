"""The wheel runs on its own: built from this checkout, installed into a fresh virtual environment and started from a
folder outside the repository, it answers --version and trains the built-in demo (the tiny model, the arithmetic
tasks and the recipe all come inside the wheel)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tandem

ROOT = Path(__file__).resolve().parents[1]


def run(*argv, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the environment's own packages
    done = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    command = " ".join(map(str, argv))
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_the_wheel_installed_elsewhere_runs_the_demo(tmp_path):
    # as a release is built: an sdist, then the wheel from the sdist (no stale build/ folder of this checkout in it)
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp_path / "dist", ROOT, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("tandem_rl-*.whl")
    # The environment sees this one's packages (torch and the rest: nothing downloaded), not this checkout's tandem.
    run(sys.executable, "-m", "venv", "--system-site-packages", tmp_path / "venv", cwd=tmp_path)
    python, command = tmp_path / "venv" / "bin" / "python", tmp_path / "venv" / "bin" / "tandem"
    run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--force-reinstall", wheel, cwd=tmp_path)
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = run(python, "-c", "import tandem; print(tandem.__file__)", cwd=work).stdout.strip()
    assert where.startswith(str(tmp_path / "venv")), f"tandem imported from {where}, not the wheel"
    version = run(command, "--version", cwd=work).stdout.strip()
    assert version == f"tandem {tandem.__version__} ({tandem.DISTRIBUTION})"
    done = run(command, "train", "demo", "--max_steps", "3", "--logging_steps", "1", cwd=work)
    assert "trained 3 steps" in done.stdout, done.stdout
    records = [json.loads(line) for line in (work / "runs" / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward" in r][-1] == 3
