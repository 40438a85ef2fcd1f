"""examples/flash_reinforce/: the FlashREINFORCE presets and the CPU example load, and their dry runs print the plan
(δ, q, batch, episodes, model) and the server command computed from the recipe; the ALFWorld environment says how to
set it up where alfworld is missing."""

import math
import re
import sys
from pathlib import Path

import pytest
import transformers

from tandem.cli import main
from tandem.recipe import import_object, load_recipe
from tests.test_config_and_cli import served_commands

FOLDER = Path("examples/flash_reinforce")
PUBLISHED_SETTINGS = {  # model, δ, q, rollouts a step, steps (the FlashREINFORCE tutorial and its launcher's settings)
    "r1": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 0.005, 1.0, 128, 6000),
    "qwen_math": ("Qwen/Qwen2.5-Math-1.5B", 0.003, 1.0, 128, 2000),
    "tool_use": ("Qwen/Qwen2.5-7B-Instruct", 0.001, 1.0, 128, 600),
    "alfworld": ("Qwen/Qwen2.5-7B-Instruct", 0.001, 0.9, 64, 200),
    "moe": ("Qwen/Qwen3-30B-A3B", 0.003, 1.0, 128, 800),
}


def dry_run(capsys, *argv: str) -> str:
    main(["train", *argv, "--dry-run"])
    return capsys.readouterr().out


def plan(out: str) -> dict[str, str]:
    """The dry run's FlashREINFORCE plan, {label: text} with continuation lines joined."""
    block = out.split("# FlashREINFORCE plan, from this recipe:\n")[1].split("\n# Generation server")[0]
    return {
        label: " ".join(text.split()) for label, text in re.findall(r"^#   (\w+) +(.*(?:\n# {13}.*)*)", block, re.M)
    }


@pytest.fixture
def bare_machine(monkeypatch):
    """No alfworld and no model files here, whatever this machine has: the dry run must not need them."""
    monkeypatch.setitem(sys.modules, "alfworld", None)

    def not_downloaded(name, **kwargs):
        raise OSError(f"{name} is not in the cache")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", not_downloaded)


def test_the_folder_holds_the_cpu_example_and_the_published_presets():
    assert {path.stem for path in FOLDER.glob("*.yaml")} == {"cpu", *PUBLISHED_SETTINGS}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SETTINGS))
def test_a_preset_dry_run_prints_its_plan_and_server(name, capsys, bare_machine):
    model, delta, q, batch, steps = PUBLISHED_SETTINGS[name]
    recipe = load_recipe(f"{FOLDER}/{name}.yaml")
    assert (recipe.model, recipe.config.algorithm, recipe.config.num_generations) == (model, "flash_reinforce", 1)
    out = dry_run(capsys, f"{FOLDER}/{name}.yaml")
    items = plan(out)
    assert items["model"] == model
    assert float(items["delta"].split()[0]) == delta == recipe.config.flash_delta
    assert float(items["q"].split()[0]) == q == recipe.config.flash_negative_token_fraction
    assert items["batch"].startswith(f"{batch} prompts a step, one rollout each (flash_batch_size)"), "exactly B"
    assert recipe.config.flash_batch_size == batch
    assert items["steps"] == f"{steps} (max_steps)" and items["episodes"] == f"{steps * batch} rollouts (steps x batch)"
    command = served_commands(out)["gpu"]
    assert command.startswith(
        f"VLLM_SERVER_DEV_MODE=1 VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 vllm serve {model} "
        f"--served-model-name {model} "
        "--logprobs-mode processed_logprobs"
    )
    assert f"--max-model-len {recipe.config.token_budget}" in command, "sized by token_budget: the prompts are not here"
    shown = out[out.index("# FlashREINFORCE plan") :]
    assert max(map(len, shown.splitlines())) <= 80, "readable in an 80-column terminal"


def test_the_cpu_example_plans_its_batch_from_its_measured_prompts(capsys):
    out = dry_run(capsys, f"{FOLDER}/cpu.yaml", "--max_steps", "-1", "--num_train_epochs", "2")
    longest = int(out.split("# --max-model-len: the longest prompt (")[1].split(" tokens")[0])
    trajectory = longest + 8  # max_completion_length
    assert all(f"--max-model-len {trajectory}" in command for command in served_commands(out).values())
    items = plan(out)
    batch = 2 * (640 // trajectory)  # gradient_accumulation_steps x trajectories a token_budget row holds
    assert items["batch"].startswith(f">= {batch} prompts a step")
    assert items["episodes"] == "256 rollouts (num_train_epochs 2 x 128 prompts)", (
        "one rollout per prompt of arithmetic-small"
    )
    assert items["steps"] == f"<= {math.ceil(256 / batch)} (episodes / batch)"


def test_a_token_budget_below_the_longest_trajectory_is_called_out(capsys):
    items = plan(dry_run(capsys, f"{FOLDER}/cpu.yaml", "--token_budget", "20"))
    assert items["batch"].startswith(">= 2 prompts a step") and "longer trajectories are dropped" in items["batch"]


def test_a_dry_run_that_cannot_measure_the_prompts_asks_for_a_token_budget(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", f"{FOLDER}/alfworld.yaml", "--token_budget", "null", "--dry-run"])
    assert stop.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "the prompts are not measured (the environment's reset() writes "
            "them). Set token_budget to the longest trajectory to train."
        )
    )


def test_the_alfworld_environment_names_its_setup_where_alfworld_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "alfworld", None)
    monkeypatch.syspath_prepend(str(Path.cwd()))
    environment = import_object(load_recipe(f"{FOLDER}/alfworld.yaml").environment_factory)
    with pytest.raises(ImportError, match=r"pip install alfworld; export ALFWORLD_DATA=DIR and run alfworld-download"):
        environment()
