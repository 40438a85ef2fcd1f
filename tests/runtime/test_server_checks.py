"""What the trainer refuses or warns about at connect, from what a server says of itself. The facts are shaped as
vLLM 0.32.0 answered `/version` and `/server_info?config_format=json` on this machine (the `vllm` tier talks to it)."""

import asyncio
import tomllib
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tandem.config import AsyncGRPOConfig
from tandem.errors import UsageError
from tandem.generation.client import ServerProblem
from tandem.generation.server_facts import ServerFacts, facts_of, release
from tandem.runtime.server_checks import (
    NEWEST_VERIFIED_VLLM,
    OLDEST_VLLM,
    check,
    check_in_flight,
    check_prompt_lengths,
    served_name,
)
from tandem.runtime.weight_sync import LoraSync, ReloadSync, choose_sync
from tandem.tasks import TINY_MODEL_PATH

URL = "http://127.0.0.1:8000"


def vllm(
    version="0.32.0",
    device="cpu",
    dtype="torch.float32",
    chunked=True,
    batched=131072,
    env=None,
    lora=None,
    transfer="gloo",
) -> ServerFacts:
    """The facts of a vLLM, from its routes' answers shaped as vLLM 0.32.0 gives them."""
    config = {
        "model_config": {"dtype": dtype, "max_model_len": 1024},
        "device_config": {"device": device},
        "scheduler_config": {"max_num_seqs": 128, "max_num_batched_tokens": batched, "enable_chunked_prefill": chunked},
        "lora_config": lora,
        "parallel_config": {},
        "weight_transfer_config": {"backend": transfer} if transfer else None,
    }
    environment = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True} if env is None else env
    return facts_of(
        {"version": version},
        {"vllm_config": config, "vllm_env": environment},
        [{"id": TINY_MODEL_PATH, "max_model_len": 1024}],
    )


def warned(facts: ServerFacts, trainer_dtype="float32") -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(facts, URL, trainer_dtype)
    return [str(w.message) for w in caught]


def test_a_server_configured_as_the_dry_run_prints_passes_silently():
    assert warned(vllm()) == []


def test_vllm_too_old_is_refused_and_newer_than_verified_is_warned_about():
    with pytest.raises(ServerProblem, match="vLLM 0.29.1; tandem needs 0.30 or later"):
        check(vllm("0.29.1"), URL, "float32")
    [message] = warned(vllm("0.33.1rc2.dev7+cpu"))
    assert "vLLM 0.33.1rc2.dev7+cpu; tandem was verified against vLLM 0.30-0.32" in message
    assert release("0.32.0") == (0, 32) and release("nightly") is None


class Control:
    """A control client that is never called: choose_sync decides from the facts alone for these servers."""

    base_url = URL


def sync_for(facts: ServerFacts, tmp_path, lora: bool):
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH)
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj"]))
    with asyncio.Runner() as run:
        return choose_sync(
            Control(), run, facts, TINY_MODEL_PATH, model, AsyncGRPOConfig(output_dir=str(tmp_path)), lora
        )


def test_lora_needs_runtime_adapter_loading_and_says_how(tmp_path):
    slots = {"max_loras": 6, "max_lora_rank": 8}  # max_staleness 4 + 2
    assert isinstance(sync_for(vllm(lora=slots), tmp_path, lora=True), LoraSync)
    with pytest.raises(ServerProblem, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
        sync_for(vllm(lora=slots, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": False}), tmp_path, lora=True)
    assert isinstance(sync_for(vllm(lora=slots, env={}), tmp_path, lora=True), LoraSync), (
        "a vLLM that lists no variables: not refused"
    )
    with pytest.raises(ServerProblem, match="max_loras=3 adapters of rank <= 8; this run needs 6"):
        sync_for(vllm(lora={"max_loras": 3, "max_lora_rank": 8}), tmp_path, lora=True)


def test_a_tied_model_is_refused_a_folder_reload_into_vllms_cpu_build_lora_fallback_included(tmp_path):
    with pytest.raises(ServerProblem, match="does not refresh a tied LM head"):
        sync_for(vllm(transfer=None), tmp_path, lora=False)
    with (
        pytest.warns(UserWarning, match="syncing the merged model"),
        pytest.raises(ServerProblem, match="does not refresh a tied LM head"),
    ):
        sync_for(vllm(transfer=None), tmp_path, lora=True)  # no LoRA on the server: the merged model would be reloaded
    assert isinstance(sync_for(vllm(transfer=None, device="cuda"), tmp_path, lora=False), ReloadSync), (
        "vLLM's GPU build reads the tied weight itself"
    )


def test_a_dtype_other_than_the_trainers_is_warned_about_on_any_server():
    [message] = warned(vllm(dtype="torch.bfloat16"))
    assert (
        "decodes in bfloat16 and the trainer holds its weights in float32" in message and "--dtype float32" in message
    )
    tandem_serve = facts_of(
        {"version": "0.33.0", "tandem_version": "1"},
        {"vllm_config": {"model_config": {"dtype": "torch.bfloat16"}}},
        [{"id": "m", "max_model_len": 64}],
    )
    assert len(warned(tandem_serve)) == 1


def test_chunked_prefill_that_can_split_a_seeded_prompt_on_vllms_cpu_build_is_warned_about():
    [message] = warned(vllm(batched=2048))
    assert "CPU Generator does not use offset" in message and "--max-num-batched-tokens 131072" in message
    assert warned(vllm(batched=2048, device="cuda")) == [], "the GPU build has no such crash"
    assert warned(vllm(batched=2048, chunked=False)) == []


def test_the_served_name_is_the_users_when_served_else_the_first_with_a_warning():
    assert served_name(["other", "my-model"], "my-model") == "my-model"
    with pytest.warns(UserWarning, match="does not serve a model named 'my-model'.*--served-model-name"):
        assert served_name(["other", "third"], "my-model") == "other"


def test_a_prompt_that_leaves_no_room_to_generate_is_refused_by_row():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    rows = [
        {"prompt": [{"role": "user", "content": "2 + 2?"}]},
        {"prompt": [{"role": "user", "content": "1 + 1 = " * 40}]},
    ]
    check_prompt_lengths(rows[:1], tokenizer, [], None, max_model_len=64)
    with pytest.raises(UsageError, match="train_dataset row 1: the prompt renders to .* max_model_len is 64"):
        check_prompt_lengths(rows, tokenizer, [], None, max_model_len=64)


def test_a_plain_text_prompt_past_the_first_rows_is_refused_by_row_before_the_first_step():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    rows = [{"prompt": [{"role": "user", "content": "2 + 2?"}]}] * 11 + [{"prompt": "What is 3 + 4?"}]
    with pytest.raises(UsageError, match="train_dataset row 11: 'prompt' must be conversational.*got str 'What is"):
        check_prompt_lengths(rows, tokenizer, [], None, max_model_len=64)


def test_the_vllm_extra_installs_the_releases_the_connect_check_takes_as_verified():
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    major, minor = NEWEST_VERIFIED_VLLM
    assert project["optional-dependencies"]["vllm"] == [f"vllm>={OLDEST_VLLM[0]}.{OLDEST_VLLM[1]},<{major}.{minor + 1}"]


def test_a_server_without_lora_settings_or_context_length_is_read_as_such():
    assert vllm(lora={}).adapters is None, "an empty lora_config: started without LoRA support"
    assert vllm(lora={"max_loras": 2, "max_lora_rank": 8}).adapters.max_loras == 2
    with pytest.raises(ServerProblem, match="says no context length"):
        facts_of({"version": "0.32.0"}, {"vllm_config": {}}, [{"id": "m"}])


def test_in_flight_weight_updates_need_labelled_tokens_and_full_weights():
    """tandem serve with a weight stream labels each token and vLLM's are labelled by when they arrive; a folder reload
    into tandem serve names no version, a LoRA request names one adapter version for its whole generation, and vLLM's
    sampling masks come from a route that is not streamed: each is refused, naming the fix."""
    in_flight = AsyncGRPOConfig(output_dir="/tmp/unused", in_flight_weight_updates=True)
    top_k = AsyncGRPOConfig(output_dir="/tmp/unused", in_flight_weight_updates=True, top_k=5)
    tandem = replace(vllm(), engine="tandem")
    check_in_flight(top_k, tandem, URL, lora=False)
    check_in_flight(top_k, vllm(), URL, lora=False)  # no sampling masks: /v1/completions, streamed
    check_in_flight(in_flight, replace(vllm(), weight_transfer=None), URL, lora=False)
    check_in_flight(AsyncGRPOConfig(output_dir="/tmp/unused"), vllm(), URL, lora=True)  # off: nothing to check
    with pytest.raises(NotImplementedError, match=r"by a folder reload.*--weight-transfer-config"):
        check_in_flight(in_flight, replace(tandem, weight_transfer=None), URL, lora=False)
    with pytest.raises(NotImplementedError, match="with LoRA"):
        check_in_flight(in_flight, tandem, URL, lora=True)
    masks = replace(vllm(), returns_sampling_masks=True)
    check_in_flight(in_flight, masks, URL, lora=False)
    with pytest.raises(NotImplementedError, match=r"top-k / top-p .* /inference/v1/generate, which is not streamed"):
        check_in_flight(top_k, masks, URL, lora=False)


def test_recomputing_the_cache_needs_a_tandem_serve_started_to_do_it_and_vllm_always_does():
    tandem = replace(vllm(), engine="tandem", recomputes_kv_cache=False)
    check(replace(tandem, recomputes_kv_cache=True), URL, "float32", recompute_kv_cache=True)
    with pytest.raises(UsageError, match="started without --recompute-kv-cache-after-weight-updates: set the field"):
        check(tandem, URL, "float32", recompute_kv_cache=True)
    with pytest.raises(UsageError, match="=False, but .* started with --recompute-kv-cache-after-weight-updates"):
        check(replace(tandem, recomputes_kv_cache=True), URL, "float32")
    assert vllm().recomputes_kv_cache, "vLLM's keep-pause drops the running sequences' caches at every sync"
    check(vllm(), URL, "float32", recompute_kv_cache=True)
    check(vllm(), URL, "float32", recompute_kv_cache=False)  # it does so whatever the field says
