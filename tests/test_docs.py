"""The docs are true: every Python block in README.md and docs/ runs as written, every `tandem train RECIPE` they show
resolves with --dry-run, the README's links reach files, and the generated reference pages match the code.

The Python blocks train for real (a few steps each): they form the `docs` tier, run by CI after the main suite:
python -m pytest -q -m docs."""

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import cli
from tandem.config import AsyncGRPOConfig
from tandem.config_checks import REFUSED

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]


def blocks(language: str) -> list[tuple[str, str]]:
    """(page:line, code) of every fenced block of `language` in the pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(rf"^```{language}\n(.*?)^```", text, re.S | re.M):
            found.append((f"{page.relative_to(ROOT)}:{text[: match.start()].count(chr(10)) + 1}", match[1]))
    return found


PLACEHOLDERS = {"recipe.yaml", "grpo_recipe.yaml"}
"""Recipe names the docs use for a reader's own file: shown, not shipped."""


def shown_train_commands() -> list[tuple[str, list[str]]]:
    """Each `tandem train RECIPE ...` of a bash or console block (after `-m` under torchrun too), as the words from
    `train` on; `--config RECIPE` is TRL's spelling of the same."""
    commands = []
    for where, code in blocks("bash") + blocks("console"):
        for line in code.replace("\\\n", " ").splitlines():  # a command continued over lines is one line
            words = shlex.split(line.split("#")[0])
            for start in [i for i, word in enumerate(words[:-1]) if word == "tandem" and words[i + 1] == "train"]:
                args = [word for word in words[start + 2 :] if word not in ("&&", ";")]
                recipe = args[1] if args[:1] == ["--config"] else args[0] if args else None
                if recipe not in PLACEHOLDERS:
                    commands.append((where, ["train", *args]))
    return commands


@pytest.mark.docs
@pytest.mark.parametrize("where, code", blocks("python"), ids=lambda value: value if ":" in str(value) else "")
def test_a_python_block_of_the_docs_runs_as_written(where, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{where}: the block failed\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("where, words", shown_train_commands(), ids=lambda value: value if ":" in str(value) else "")
def test_a_train_command_the_docs_show_resolves_with_dry_run(where, words, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # in this process: a command of its own would spend ~4 s importing what this one has
    # What the command line sets for the processes it starts is undone after (its warning format: conftest.py).
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", ""))
    monkeypatch.setattr(sys, "path", list(sys.path))  # a recipe's folder, where its reward functions are imported from
    try:
        cli.main([*words, "--dry-run"])
    except SystemExit as exit:
        assert exit.code in (0, None), f"{where}: {' '.join(words)} --dry-run failed\n{capsys.readouterr().err[-2000:]}"


def test_the_docs_show_the_demo_command():
    assert any(words[:2] == ["train", "demo"] for _, words in shown_train_commands())


def test_the_readmes_links_reach_files_of_the_repository():
    text = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text) if not t.startswith(("http", "#"))]
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert targets and not missing, f"README.md links to files that do not exist: {missing}"


def test_the_generated_reference_pages_match_the_code():
    done = subprocess.run(
        [sys.executable, "scripts/generate_docs.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_every_config_field_says_what_it_does():
    spec = importlib.util.spec_from_file_location("generate_docs", ROOT / "scripts" / "generate_docs.py")
    generate_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate_docs)
    docs, _ = generate_docs.field_docs()
    names = [f.name for f in dataclasses.fields(AsyncGRPOConfig)]
    said = {name: f"{docs.get(name, '')} {REFUSED.get(name, '')}" for name in names}  # a refusal says why
    bare = [name for name, text in said.items() if len(text.split()) < 5]
    assert not bare, f"fields without a docstring that says what they do: {bare}"
