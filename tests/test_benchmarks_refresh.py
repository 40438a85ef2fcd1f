"""benchmarks/refresh.py rewrites exactly the marked table it re-measured; no benchmark runs here."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_refresh():
    spec = importlib.util.spec_from_file_location("refresh", ROOT / "benchmarks" / "refresh.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


refresh = load_refresh()

README = """intro
<!-- bench:proxy -->
| a |
|---:|
| 1 |

Measured at commit `old` on 2020-01-01.
<!-- /bench -->
between
<!-- bench:packing -->
| b |
|---:|
| 2 |

Measured at commit `old` on 2020-01-01.
<!-- /bench -->
outro
"""


def test_replace_table_rewrites_only_its_own_block():
    text = refresh.replace_table(README, "proxy", "| a |\n|---:|\n| 3 |\n", "Measured at commit `new` on 2030-01-01.")
    assert text == README.replace(
        "| 1 |\n\nMeasured at commit `old` on 2020-01-01.", "| 3 |\n\nMeasured at commit `new` on 2030-01-01.", 1
    )


def test_replace_table_refuses_a_missing_or_repeated_block():
    with pytest.raises(ValueError, match="found 0"):
        refresh.replace_table(README, "weight_sync", "| c |\n", "stamp")
    with pytest.raises(ValueError, match="found 2"):
        refresh.replace_table(README + README, "proxy", "| c |\n", "stamp")


def test_the_performance_page_has_one_block_for_every_benchmark():
    text = refresh.PAGE.read_text()
    for name in refresh.BENCHMARKS:
        refresh.replace_table(text, name, "| x |\n", "stamp")
        assert (ROOT / "benchmarks" / f"{name}.py").is_file()


def test_the_mismatch_benchmark_goes_on_where_a_stopped_refresh_left_off(tmp_path, monkeypatch, capsys):
    """Its 60 runs take hours: each finished run is kept, and reused while the code it measured is unchanged."""
    import subprocess
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("mismatch", ROOT / "benchmarks" / "mismatch.py")
    mismatch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mismatch)
    monkeypatch.setattr(mismatch, "KEPT", tmp_path / "kept.jsonl")
    measured = []

    def run(setup, correction, staleness, steps, seed):
        measured.append((setup, staleness, correction, seed))
        return [{"reward": 0.5 + i / 100, "time": i, "perf/step_s": 1.0} | sampling for i in range(steps)]

    sampling = {"sampling/effective_sample_size": 0.99, "sampling/mismatch_kl": 1e-3}
    changed = False
    monkeypatch.setattr(mismatch, "run", run)
    monkeypatch.setattr(
        mismatch,
        "git",
        lambda *args: subprocess.CompletedProcess(args, int(changed and args[0] == "diff"), stdout="c0ffee\n"),
    )
    monkeypatch.setattr(sys, "argv", ["mismatch.py", "--runs", "1", "--steps", "40"])
    mismatch.main()
    cells = len(mismatch.SETUPS) * len(mismatch.STALENESS) * len(mismatch.CORRECTIONS)
    assert len(measured) == cells
    first_table = capsys.readouterr().out.split("\n\n")[-1]
    assert "| setup |" in first_table, first_table

    mismatch.main()
    assert len(measured) == cells, "a run kept from the first refresh was measured again"
    out = capsys.readouterr().out
    assert out.count("(kept from an earlier refresh)") == cells and out.split("\n\n")[-1] == first_table

    changed = True  # the measured code differs from the kept runs' commit
    mismatch.main()
    assert len(measured) == 2 * cells, "a run of other code was reused"
    monkeypatch.setattr(sys, "argv", ["mismatch.py", "--runs", "1", "--steps", "40", "--fresh"])
    changed = False
    mismatch.main()
    assert len(measured) == 3 * cells, "--fresh reused a kept run"
