"""Each integration's example learns on the tiny model, run whole as a user runs it: the mean reward of its last 20
steps is at least its first 20 steps' + 0.15. Long (4 to 9 minutes each on 2 cores): `python -m pytest -q -m long`;
the fast tests of each integration cover the parts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"


def rise(run: Path) -> tuple[float, float]:
    rewards = [r["reward"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward" in r]
    assert len(rewards) >= 100, f"{len(rewards)} steps logged a reward"
    return sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20


@pytest.mark.long
@pytest.mark.parametrize(
    "command, run",
    [
        ([sys.executable, str(EXAMPLES / "openenv_counter.py")], "runs/openenv_counter"),
        ([sys.executable, str(EXAMPLES / "verifiers_arithmetic.py")], "runs/verifiers_arithmetic"),
        ([sys.executable, "-m", "tandem", "train", str(EXAMPLES / "reasoning_gym.yaml")], "runs/reasoning_gym"),
    ],
)
def test_the_example_learns(command, run, tmp_path):
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    first, last = rise(tmp_path / run)
    assert last >= first + 0.15, f"mean reward, first 20 steps {first:.3f}, last 20 {last:.3f}"
