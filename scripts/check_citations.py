"""Fail on text a reader of this repository cannot follow: citations of documents that are not in it (design
notes, numbered specifications, a `reference/` folder) and words in another language than English.

Every tracked text file is read (`git ls-files`). Greek letters and mathematical signs are English text here (δ, ε,
π_θ, ∇); letters of the scripts in FOREIGN are not.

    python scripts/check_citations.py          # exit 1, one line per finding: path:line: what
"""

import re
import subprocess
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATIONS = [
    (re.compile(r"(?<![a-z0-9])spec[ _-]?0\d\d", re.I), "a numbered specification"),
    (re.compile(r"(?<![a-z])the[ _]spec(?![a-z])", re.I), "the specification"),
    (re.compile(r"\bdesign\.md\b", re.I), "a design document"),
    (re.compile(r"(?<![a-z])design[ _]notes(?![a-z])", re.I), "a design document's notes"),
    (re.compile(r"(?<![\w./-])reference/\w"), "a reference/ folder"),
]
FOREIGN = {
    "ARABIC",
    "ARMENIAN",
    "BENGALI",
    "CJK",
    "CYRILLIC",
    "DEVANAGARI",
    "ETHIOPIC",
    "GEORGIAN",
    "GUJARATI",
    "GURMUKHI",
    "HALFWIDTH",
    "HANGUL",
    "HEBREW",
    "HIRAGANA",
    "KANNADA",
    "KATAKANA",
    "KATAKANA-HIRAGANA",
    "KHMER",
    "LAO",
    "MALAYALAM",
    "MYANMAR",
    "SINHALA",
    "TAMIL",
    "TELUGU",
    "THAI",
    "TIBETAN",
}
"""Writing systems of other languages, by the first word of their letters' Unicode names."""
TEXT_SUFFIXES = {
    ".py",
    ".md",
    ".yaml",
    ".yml",
    ".toml",
    ".sh",
    ".txt",
    ".cfg",
    ".json",
    ".jsonl",
    ".jinja",
    ".html",
    "",
}


def script(char: str) -> str | None:
    """The writing system of a letter (LATIN, GREEK, HANGUL, CJK, ...); None for anything that is not a letter."""
    if char.isascii() or not unicodedata.category(char).startswith("L"):
        return None
    return unicodedata.name(char, "UNKNOWN").split()[0]


def findings(path: str, text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, what in CITATIONS:
            if pattern.search(line):
                found.append(f"{path}:{number}: cites {what}: {line.strip()[:100]}")
        foreign = sorted({s for s in map(script, line) if s in FOREIGN})
        if foreign:
            found.append(f"{path}:{number}: text in {', '.join(foreign)} script: {line.strip()[:100]}")
    return found


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [
        p
        for p in listed.splitlines()
        if Path(p).suffix in TEXT_SUFFIXES and (ROOT / p).is_file() and not (ROOT / p).is_symlink()
    ]


def main() -> int:
    found = []
    for path in tracked_files():
        try:
            found += findings(path, (ROOT / path).read_text())
        except UnicodeDecodeError:
            continue  # not text
    summary = "\n".join(found) or "no citations and no text in other languages"
    print(summary, file=sys.stderr if found else sys.stdout)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
