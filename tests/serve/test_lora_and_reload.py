"""Runtime LoRA adapters (several live, mixed in one batch) and weight reloads, checked against PEFT / HF forwards."""

import concurrent.futures
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tandem.kernels import onednn_linear
from tandem.tasks import TINY_MODEL_PATH
from tests.conftest import ServerThread, chat_prompt
from tests.serve.test_streaming import sse_events

ATOL = 1e-5


def make_adapter(path, seed: int, rank: int = 4) -> None:
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    model.save_pretrained(str(path))


def teacher_logprobs(model, prompt, output) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1)[torch.arange(len(output)), torch.tensor(output)]


def complete(server, prompt, model=None, seed=0):
    body = {"prompt": prompt, "max_tokens": 12, "logprobs": 0, "return_token_ids": True, "seed": seed}
    if model:
        body["model"] = model
    status, answer = server.post("/v1/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    return choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"])


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    paths = {name: root / name for name in ("alpha", "beta", "gamma", "delta")}
    for seed, path in enumerate(paths.values()):
        make_adapter(path, seed)
    return paths


def test_adapters_load_serve_mixed_batches_and_match_peft(server, adapters, tokenizer):
    for name in ("alpha", "beta"):
        status, text = server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters[name])})
        assert (status, text) == (200, f"Success: LoRA adapter '{name}' added successfully.")
    status, body = server.post("/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters["alpha"])})
    assert status == 400 and "has already been loaded" in body["error"]["message"]
    names = [m["id"] for m in server.get("/v1/models")[1]["data"]]
    assert "alpha" in names and "beta" in names

    prompt = chat_prompt(tokenizer, "What is 31 + 12?")
    jobs = [(None, i) for i in range(4)] + [("alpha", i) for i in range(4)] + [("beta", i) for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:  # base, alpha and beta requests share batches
        results = list(pool.map(lambda job: complete(server, prompt, *job), jobs))
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32).eval()
    references = {None: base}
    for name in ("alpha", "beta"):
        references[name] = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32), str(adapters[name])
        ).eval()
    for (name, _), (tokens, logprobs) in zip(jobs, results):
        expected = teacher_logprobs(references[name], prompt, tokens)
        assert torch.allclose(logprobs, expected, atol=ATOL), (
            f"adapter {name}: log-probs drift by {(logprobs - expected).abs().max():.2e}"
        )
    other = teacher_logprobs(references["beta"], prompt, results[4][0])
    assert not torch.allclose(results[4][1], other, atol=1e-3), "alpha's log-probs must differ from beta's"


def test_fast_decoding_serves_adapters_over_base_layers_on_onednn(adapters, tokenizer, monkeypatch):
    """PEFT wraps the layers the engine routed to oneDNN: the adapter's product adds to the reordered base layer's."""
    monkeypatch.setattr(onednn_linear, "MIN_ELEMENTS", 0)  # the tiny model's layers too
    fast = ServerThread(logprobs_mode="processed_logprobs", enable_lora=True, decode_mode="fast")
    try:
        assert fast.post("/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters["alpha"])})[0] == 200
        prompt = chat_prompt(tokenizer, "What is 5 + 9?")
        tokens, logprobs = complete(fast, prompt, "alpha", seed=2)
        wrapped = fast.server.engine.model.get_base_model().model.layers[0].self_attn.q_proj
        assert onednn_linear.routed(wrapped.base_layer) and wrapped.base_layer.onednn_weight is not None
    finally:
        fast.close()
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32), str(adapters["alpha"])
    ).eval()
    expected = teacher_logprobs(reference, prompt, tokens)
    assert torch.allclose(logprobs, expected, atol=1e-4), f"log-probs drift by {(logprobs - expected).abs().max():.2e}"


def test_unload_removes_the_name_and_eviction_reloads_from_disk(server, adapters, tokenizer):
    prompt = chat_prompt(tokenizer, "What is 5 + 9?")
    tokens_before, logprobs_before = complete(server, prompt, "alpha", seed=9)
    for name in ("gamma", "delta"):  # with max_cpu_loras=3, loading these evicts the oldest weights
        assert server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters[name])})[0] == 200
        complete(server, prompt, name)
    tokens_after, logprobs_after = complete(server, prompt, "alpha", seed=9)
    assert tokens_after == tokens_before and torch.allclose(logprobs_after, logprobs_before, atol=ATOL)
    for name in ("alpha", "beta", "gamma", "delta"):
        assert server.post("/v1/unload_lora_adapter", {"lora_name": name})[0] == 200
    status, body = server.post("/v1/completions", {"prompt": prompt, "model": "alpha"})
    assert status == 404


def test_a_name_reloaded_after_its_unload_serves_the_new_weights_and_a_vanished_adapter_fails_alone(
    adapters, tokenizer, tmp_path
):
    """The trainer's resume reuses adapter names; a single loaded adapter replaced by itself must keep the
    engine alive, and an evicted adapter whose files are gone fails only its own request."""
    solo = ServerThread(logprobs_mode="processed_logprobs", enable_lora=True, max_loras=1)
    try:
        prompt = chat_prompt(tokenizer, "What is 3 + 4?")
        for source in ("alpha", "beta"):
            assert (
                solo.post("/v1/load_lora_adapter", {"lora_name": "policy", "lora_path": str(adapters[source])})[0]
                == 200
            )
            tokens, logprobs = complete(solo, prompt, "policy", seed=4)
            peft = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32), str(adapters[source])
            ).eval()
            assert torch.allclose(logprobs, teacher_logprobs(peft, prompt, tokens), atol=ATOL), f"served {source}?"
            assert solo.post("/v1/unload_lora_adapter", {"lora_name": "policy"})[0] == 200

        make_adapter(tmp_path / "gone", seed=7)
        for name, path in (
            ("gone", tmp_path / "gone"),
            ("other", adapters["gamma"]),
        ):  # max_cpu_loras 1: "gone" is evicted
            assert solo.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})[0] == 200
        shutil.rmtree(tmp_path / "gone")  # an evicted adapter is read again from its files on its next use
        status, body = solo.post("/v1/completions", {"prompt": prompt, "model": "gone", "max_tokens": 4})
        assert status == 500 and "Loading lora gone failed" in body["error"]["message"]
        events = sse_events(
            solo.port, "/v1/completions", {"prompt": prompt, "model": "gone", "max_tokens": 4, "stream": True}
        )
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500, "streamed, the failure is an error event"
        assert "Loading lora gone failed" in events[-2]["error"]["message"]
        assert solo.post("/v1/completions", {"prompt": prompt, "max_tokens": 4})[0] == 200, "the engine kept serving"
    finally:
        solo.close()


def test_adapter_rank_above_max_lora_rank_is_refused(server, tmp_path):
    make_adapter(tmp_path / "wide", seed=5, rank=32)
    status, body = server.post("/v1/load_lora_adapter", {"lora_name": "wide", "lora_path": str(tmp_path / "wide")})
    assert status == 500 and "LoRA rank 32 is greater than max_lora_rank 16." in body["error"]["message"]


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_reload_weights_swaps_the_model_between_steps(tmp_path, tokenizer, mode, monkeypatch):
    """In fast mode on a CPU the linear layers compute on copies of the weights reordered for oneDNN: they follow the
    reload too."""
    monkeypatch.setattr(onednn_linear, "MIN_ELEMENTS", 0)  # the tiny model's layers too
    torch.manual_seed(0)
    changed = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    weights = tmp_path / "v1"
    weights.mkdir()
    state = {
        k: v.contiguous() for k, v in changed.state_dict().items() if k != "lm_head.weight"
    }  # tied to the embedding
    save_file(state, str(weights / "model.safetensors"))

    s = ServerThread(logprobs_mode="processed_logprobs", decode_mode=mode)
    try:
        prompt = chat_prompt(tokenizer, "What is 8 + 8?")
        complete(s, prompt, seed=4)  # served before the reload (fast mode: the weights reordered for oneDNN)
        assert s.request("POST", "/pause?mode=keep")[0] == 200
        status, _ = s.post(
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(weights), "is_checkpoint_format": True}},
        )
        assert status == 200
        assert s.post("/reset_prefix_cache")[0] == 200 and s.request("POST", "/resume")[0] == 200
        tokens, logprobs = complete(s, prompt, seed=4)
        expected = teacher_logprobs(changed, prompt, tokens)
        atol = ATOL if mode == "exact" else 1e-4  # fast: SDPA and oneDNN round apart from the forward
        assert torch.allclose(logprobs, expected, atol=atol), (
            f"served log-probs are not the new weights' ({(logprobs - expected).abs().max():.2e})"
        )

        bad = tmp_path / "bad"
        bad.mkdir()
        save_file({"model.not_a_layer.weight": torch.zeros(2)}, str(bad / "model.safetensors"))
        status, body = s.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(bad)}})
        assert status == 400 and "is not a parameter of the served model" in body["error"]["message"]
    finally:
        s.close()
