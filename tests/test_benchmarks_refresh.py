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
