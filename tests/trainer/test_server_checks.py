"""What the trainer refuses or warns about at connect, from what a server says of itself. The facts are shaped as
vLLM 0.32.0 answered `/version` and `/server_info?config_format=json` on this machine (the `vllm` tier talks to it)."""

import warnings

import pytest

from tandem.generation.client import ServerProblem
from tandem.trainer.server_checks import ServerFacts, check, release

URL = "http://127.0.0.1:8000"


def vllm(version="0.32.0", device="cpu", dtype="torch.float32", chunked=True, batched=131072, lora_env=True) -> ServerFacts:
    config = {"model_config": {"dtype": dtype, "max_model_len": 1024}, "device_config": {"device": device},
              "scheduler_config": {"max_num_seqs": 128, "max_num_batched_tokens": batched, "enable_chunked_prefill": chunked},
              "lora_config": None, "weight_transfer_config": {"backend": "gloo"}}
    return ServerFacts(version, tandem=False, config=config, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": lora_env})


def warned(facts: ServerFacts, trainer_dtype="float32", lora=False) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(facts, URL, trainer_dtype, lora)
    return [str(w.message) for w in caught]


def test_a_server_configured_as_the_dry_run_prints_passes_silently():
    assert warned(vllm()) == []
    assert warned(vllm(lora_env=True), lora=True) == []


def test_vllm_too_old_is_refused_and_newer_than_verified_is_warned_about():
    with pytest.raises(ServerProblem, match="vLLM 0.29.1; tandem needs 0.30 or later"):
        check(vllm("0.29.1"), URL, "float32", False)
    [message] = warned(vllm("0.33.1rc2.dev7+cpu"))
    assert "vLLM 0.33.1rc2.dev7+cpu; tandem was verified against vLLM 0.30-0.32" in message
    assert release("0.32.0") == (0, 32) and release("nightly") is None


def test_lora_needs_runtime_adapter_loading_and_says_how():
    with pytest.raises(ServerProblem, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
        check(vllm(lora_env=False), URL, "float32", lora=True)
    assert warned(vllm(lora_env=False), lora=False) == [], "full-weight runs load no adapter"
    unlisted = vllm()
    unlisted.env = {}
    assert warned(unlisted, lora=True) == [], "a vLLM that does not list its variables is not refused on a guess"


def test_a_dtype_other_than_the_trainers_is_warned_about_on_any_server():
    [message] = warned(vllm(dtype="torch.bfloat16"))
    assert "decodes in bfloat16 and the trainer holds its weights in float32" in message and "--dtype float32" in message
    tandem_serve = ServerFacts("0.33.0", tandem=True, config={"model_config": {"dtype": "torch.bfloat16"}}, env={})
    assert len(warned(tandem_serve)) == 1


def test_chunked_prefill_that_can_split_a_seeded_prompt_on_vllms_cpu_build_is_warned_about():
    [message] = warned(vllm(batched=2048))
    assert "CPU Generator does not use offset" in message and "--max-num-batched-tokens 131072" in message
    assert warned(vllm(batched=2048, device="cuda")) == [], "the GPU build has no such crash"
    assert warned(vllm(batched=2048, chunked=False)) == []
