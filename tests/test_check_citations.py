"""The repository stands on its own: scripts/check_citations.py finds a planted citation or line in another language,
and finds none in the repository."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_citations", ROOT / "scripts" / "check_citations.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def test_each_kind_of_citation_and_foreign_text_is_found_on_its_line():
    planted = "\n".join(
        [
            "fine: the importance ratio π_θ / μ, δ = 1e-3",
            "as " + "spec" + " 002 says",
            "see " + "DESIGN" + ".md",
            "read " + "reference" + "/vllm_protocol.md",
            "what the " + "spec" + " requires",
            "def test_the_" + "spec" + "_example():",
            "def test_the_presets_of_" + "spec" + "_004s():",
            "as the design" + " notes say",
            "an English line, then " + chr(0xBCF4) + chr(0xC0C1),
            "a comment in " + chr(0x65E5) + chr(0x672C) + chr(0x8A9E),
        ]
    )
    found = check.findings("planted.py", planted)
    assert [line.split(":")[1] for line in found] == ["2", "3", "4", "5", "6", "7", "8", "9", "10"], found
    assert "HANGUL" in found[7] and "CJK" in found[8]


def test_the_repository_cites_nothing_a_reader_cannot_open():
    done = subprocess.run([sys.executable, "scripts/check_citations.py"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
