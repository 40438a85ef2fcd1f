"""`tandem train RECIPE [--field value ...]`: the recipe read, its objects imported, its trainer built and run,
and the run's last lines."""

import argparse
import os
import signal
import sys

import yaml

from tandem.cli.dry_run import dry_run
from tandem.cli.serve import missing_folder
from tandem.cli.user_input import lora_config, user_error
from tandem.errors import UsageError

TRAIN_HELP = """\
examples:
  tandem train demo                  the built-in demo: the tiny model learns
                                     2-digit arithmetic (about 2 minutes)
  tandem train demo --max_steps 20   any field as a flag, over the recipe's
  tandem train recipe.yaml --dry-run the resolved recipe and the vllm serve
                                     command it needs; starts nothing
  tandem train --config recipe.yaml  TRL's spelling of tandem train recipe.yaml

a recipe is a YAML mapping of these keys:
  model           a model folder (safetensors), a Hub id (org/name), or tiny
  dataset         a built-in task (arithmetic, arithmetic-small,
                  arithmetic-test), a local .json, .jsonl, .parquet or .csv
                  file or a folder, a Hub id, reasoning-gym:<task> or
                  verifiers:<taskset id>; with dataset_config, dataset_split,
                  dataset_streaming, dataset_options
  eval_dataset    prompts evaluated while training; with eval_split,
                  eval_dataset_options and the eval_strategy field
  reward_funcs    import paths of reward functions (package.module:function)
  tools           import paths of tool functions the model may call
  environment_factory
                  an environment class's import path, or names -> paths
  lora            peft.LoraConfig fields (r, lora_alpha, target_modules, ...):
                  train a LoRA adapter instead of the whole model
  and every AsyncGRPOConfig field (learning_rate, num_generations,
  max_staleness, token_budget, ...), each also a flag: --field value.

TRL's names (model_name_or_path, use_peft, lora_r, use_vllm, beta, ...) are
read as tandem's with a note, or refused where they cannot act, saying why.
Every key is described in
  {reference}.
"""


def train_parser(sub) -> None:
    from tandem.recipe import FIELD_REFERENCE

    p = sub.add_parser(
        "train",
        help="train with async GRPO from a YAML recipe",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=TRAIN_HELP.format(reference=FIELD_REFERENCE.replace(", ", ",\n  ")),
        description="Train from a recipe: a YAML file of AsyncGRPOConfig fields and the keys\nbelow, "
        "or a built-in recipe's name (demo).",
    )
    p.add_argument("recipe", nargs="?", help="a YAML recipe file, or a built-in recipe's name (demo)")
    p.add_argument("--config", metavar="RECIPE", help="the recipe, as TRL's scripts take it (instead of RECIPE)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the resolved recipe and the vllm serve command; start nothing"
    )


def run_train(ns: argparse.Namespace, overrides: list[str]) -> None:
    recipe = read_recipe(ns, overrides)
    reward_funcs, tools, environments = recipe_objects(ns.recipe, recipe)
    if ns.dry_run:
        try:
            dry_run(ns.recipe, recipe, tools, agent=bool(tools or environments))
        except UsageError as exc:  # a lora field peft refuses, a tool it cannot describe
            user_error(f"tandem train: {ns.recipe}: {exc}")
        return
    if problem := missing_folder(recipe.model):
        user_error(f"tandem train: {ns.recipe}: {problem}")
    try:
        trainer = build_trainer(recipe, reward_funcs, tools, environments)
    except (UsageError, NotImplementedError) as exc:  # no such dataset, config or split; settings the trainer refuses
        user_error(f"tandem train: {ns.recipe}: {exc}")
    except OSError as exc:  # a Hub model or dataset that does not load (its own message names which)
        user_error(f"tandem train: {ns.recipe}: {' '.join(str(exc).split())}")
    from tandem.generation.client import ServerProblem

    try:
        output = trainer.train()
        if recipe.config.push_to_hub and not trainer.runtime.preempted.is_set():
            trainer.push_to_hub()  # the final model, as a transformers script ends (checkpoints went as they were saved)
    except (UsageError, NotImplementedError) as exc:  # no checkpoint to resume from; a prompt longer than the
        # server's context; a setting the server found at connect cannot serve (in_flight_weight_updates on vLLM)
        user_error(f"tandem train: {ns.recipe}: {exc}")
    except ServerProblem as exc:  # a server that cannot be reached, refuses the run, or serves other weights
        user_error(f"tandem train: {exc}")
    if trainer.ranks.several:  # torchrun: rank 0 reports for all
        import torch.distributed

        torch.distributed.destroy_process_group()
        if not trainer.ranks.main:
            return
    report_end(trainer, output, recipe.config)


def read_recipe(ns: argparse.Namespace, overrides: list[str]):
    """The one recipe named (as RECIPE or TRL's --config RECIPE) with the flags applied, its TRL notes printed;
    `ns.recipe` names it from here on."""
    from tandem.recipe import load_recipe

    if (ns.recipe is None) == (ns.config is None):
        user_error(
            "tandem train: give one recipe: tandem train RECIPE (a YAML file, or demo) or tandem train --config "
            "RECIPE" + ("" if ns.recipe is None else f", not both ({ns.recipe}, {ns.config})")
        )
    ns.recipe = ns.recipe or ns.config
    try:
        recipe = load_recipe(ns.recipe, overrides)
    except (OSError, UsageError, yaml.YAMLError) as exc:  # a missing file, an unknown key, a bad value, broken YAML
        user_error(f"tandem train: {ns.recipe}: {exc}")
    for note in recipe.notes:
        print(f"tandem train: {ns.recipe}: note: {note}", file=sys.stderr)
    return recipe


def recipe_objects(source: str, recipe) -> tuple[list, list, object]:
    """The recipe's reward functions, tools and environment factory, imported from their paths (which resolve from
    the current directory too, as under `python -m tandem`); a path that does not resolve is the user's error."""
    from tandem.recipe import import_object

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        reward_funcs, tools = [import_object(f) for f in recipe.reward_funcs], [import_object(t) for t in recipe.tools]
        environments = recipe.environment_factory
        if isinstance(environments, dict):
            return reward_funcs, tools, {name: import_object(path) for name, path in environments.items()}
        return reward_funcs, tools, import_object(environments) if environments else None
    except UsageError as exc:
        user_error(f"tandem train: {source}: {exc}")


def build_trainer(recipe, reward_funcs: list, tools: list, environments):
    """The recipe's datasets loaded and its trainer built (everything that can refuse the recipe before training)."""
    from tandem import AsyncGRPOTrainer
    from tandem.tasks import datasets

    train = (
        datasets.load(
            recipe.dataset,
            recipe.dataset_config,
            recipe.dataset_split,
            recipe.dataset_streaming,
            recipe.dataset_options,
        )
        if recipe.dataset
        else None
    )
    evaluate = (
        datasets.load(
            recipe.eval_dataset, recipe.dataset_config, recipe.eval_split, options=recipe.eval_dataset_options
        )
        if recipe.eval_dataset
        else None
    )
    return AsyncGRPOTrainer(
        model=recipe.model,
        reward_funcs=reward_funcs,
        args=recipe.config,
        train_dataset=train,
        eval_dataset=evaluate,
        peft_config=lora_config(recipe.lora) if recipe.lora is not None else None,
        tools=tools or None,
        environment_factory=environments,
    )


def report_end(trainer, output, config) -> None:
    """The run's last lines: its steps, where its checkpoints and metrics are, and the reward's rise; a run stopped
    by SIGTERM before its last step exits as SIGTERM would."""
    history = trainer.reward_history
    print(
        f"\ntrained {output.global_step} steps; checkpoints in {config.output_dir}, "
        f"metrics in {config.output_dir}/metrics.jsonl"
    )
    if history:
        head, tail = history[:20], history[-20:]
        print(
            f"mean reward, first {len(head)} steps: {sum(head) / len(head):.3f}   last {len(tail)} steps: {sum(tail) / len(tail):.3f}"
        )
    if trainer.runtime.preempted.is_set() and not 0 < config.max_steps <= output.global_step:
        sys.exit(128 + signal.SIGTERM)  # as a process SIGTERM ended: a job script must not take the run as finished
