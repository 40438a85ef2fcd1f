"""Automatic prefix caching: a later turn prefills only its new tokens, its log-probs stay bitwise those of a full
forward, and nothing cached survives a change of weights.

Sequences here stay under 192 tokens: beyond that this CPU's matmul (MKL) splits attention's sum over the keys
differently for every key count, so exact decoding matches a forward bit for bit only up to there, with or
without the cache.
"""

import random
import time

import pytest
import torch
from safetensors.torch import save_file

from tandem.generation.client import parse_prometheus
from tandem.serve.prefix_cache import PrefixCache
from tandem.serve.requests import EngineRequest
from tandem.serve.sampling import SamplingParams
from tests.conftest import ServerThread
from tests.serve.test_engine import make_engine, random_prompt, run, teacher_forced, wait
from tests.serve.test_lora_and_reload import make_adapter

TOOL_RESPONSE = "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
OUTPUT_TOKENS = 24


@pytest.fixture(scope="module")
def uncached_server():
    s = ServerThread(logprobs_mode="processed_logprobs", enable_prefix_caching=False)
    yield s
    s.close()


def counter(server, name: str) -> float:
    return next(value for metric, _, value in parse_prometheus(server.get("/metrics")[1]) if metric == name)


def complete(server, prompt: list[int], seed: int) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 1.0,
        "seed": seed,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }
    status, answer = server.post("/v1/completions", body)
    assert status == 200, answer
    return answer["choices"][0]


def two_turns(server, tokenizer, question: str) -> tuple[list[int], dict, float]:
    """Turn 2's prompt is turn 1's prompt + its output + a tool response. Returns that prompt, turn 2's choice
    and the tokens turn 2 found cached."""
    first = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    output = complete(server, first, seed=1)["token_ids"]
    complete(server, list(range(3, 90)), seed=0)  # another conversation takes the cache row turn 1 left
    second = first + output + tokenizer.encode(TOOL_RESPONSE, add_special_tokens=False)
    hits = counter(server, "vllm:prefix_cache_hits_total")
    choice = complete(server, second, seed=2)
    return second, choice, counter(server, "vllm:prefix_cache_hits_total") - hits


def test_a_second_turn_prefills_only_its_new_tokens_and_its_logprobs_equal_a_full_forward_bit_for_bit(
    server, tiny_model, tokenizer
):
    prompt, choice, hits = two_turns(server, tokenizer, "What is 17 + 25? Use the calculator.")
    first_turn_with_kv = (
        len(prompt) - len(tokenizer.encode(TOOL_RESPONSE, add_special_tokens=False)) - 1
    )  # the last output token has none
    assert hits == first_turn_with_kv // 16 * 16, "turn 2 should find every whole block of turn 1 cached"
    expected = teacher_forced(tiny_model, prompt, choice["token_ids"], SamplingParams(temperature=1.0))
    picked = expected[torch.arange(OUTPUT_TOKENS), torch.tensor(choice["token_ids"])]
    served = torch.tensor(choice["logprobs"]["token_logprobs"])
    assert torch.equal(served, picked), f"log-probs after a cache hit drift by {(served - picked).abs().max():.2e}"


def test_without_prefix_caching_nothing_hits_and_the_results_are_the_same(server, uncached_server, tokenizer):
    _, cached, _ = two_turns(server, tokenizer, "What is 60 - 13? Use the calculator.")
    _, uncached, hits = two_turns(uncached_server, tokenizer, "What is 60 - 13? Use the calculator.")
    assert hits == 0 and counter(uncached_server, "vllm:prefix_cache_queries_total") == 0
    assert uncached["token_ids"] == cached["token_ids"]
    assert uncached["logprobs"]["token_logprobs"] == cached["logprobs"]["token_logprobs"]
    _, info = uncached_server.get("/server_info", {"config_format": "json"})
    assert info["vllm_config"]["cache_config"]["enable_prefix_caching"] is False
    assert 'enable_prefix_caching="False"' in uncached_server.get("/metrics")[1]
    assert 'enable_prefix_caching="True"' in server.get("/metrics")[1]


def test_prompt_logprobs_requests_read_nothing_from_the_cache(server):
    """vLLM skips the cache for them: their logits at every prompt position must be computed."""
    prompt = list(range(3, 70))
    complete(server, prompt, seed=0)
    hits = counter(server, "vllm:prefix_cache_hits_total")
    status, _ = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 0})
    assert status == 200 and counter(server, "vllm:prefix_cache_hits_total") == hits


def test_a_reset_a_weight_reload_and_adapter_loads_and_unloads_each_drop_the_cache(tmp_path, tiny_model):
    weights = tmp_path / "weights"
    weights.mkdir()
    save_file(
        {k: v.contiguous() for k, v in tiny_model.state_dict().items() if k != "lm_head.weight"},
        str(weights / "model.safetensors"),
    )
    make_adapter(tmp_path / "adapter", seed=0)
    s = ServerThread(enable_lora=True)
    try:
        prompt = list(range(3, 60))

        def hits_of_a_repeat() -> float:
            complete(s, prompt, seed=0)
            before = counter(s, "vllm:prefix_cache_hits_total")
            complete(s, prompt, seed=0)
            return counter(s, "vllm:prefix_cache_hits_total") - before

        def hits_after(method: str, path: str, body=None) -> float:
            assert s.request(method, path, body)[0] == 200, path
            before = counter(s, "vllm:prefix_cache_hits_total")
            complete(s, prompt, seed=0)
            return counter(s, "vllm:prefix_cache_hits_total") - before

        assert hits_of_a_repeat() == 48
        assert hits_after("POST", "/reset_prefix_cache") == 0, "/reset_prefix_cache"
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}}
        assert hits_after("POST", "/collective_rpc", reload) == 0, "a weight reload"
        load = {"lora_name": "adapter", "lora_path": str(tmp_path / "adapter")}
        assert hits_after("POST", "/v1/load_lora_adapter", load) == 0, "an adapter load"
        assert hits_after("POST", "/v1/unload_lora_adapter", {"lora_name": "adapter"}) == 0, "an adapter unload"
    finally:
        s.close()


def test_pause_clears_the_cache_unless_clear_cache_is_false_as_in_vllm(server):
    """vLLM's /pause drops the prefix cache after draining (abort, wait) unless `clear_cache=false`; keep freezes the
    running sequences and leaves the cache alone. A value other than a boolean is a 400 naming it."""
    prompt = list(range(100, 150))
    complete(server, prompt, seed=0)

    def hits_after_pause(query: str) -> float:
        assert server.request("POST", f"/pause?{query}")[0] == 200, query
        assert server.request("POST", "/resume")[0] == 200
        before = counter(server, "vllm:prefix_cache_hits_total")
        complete(server, prompt, seed=0)
        return counter(server, "vllm:prefix_cache_hits_total") - before

    assert hits_after_pause("mode=wait&clear_cache=false") == 48, "clear_cache=false dropped the cache"
    assert hits_after_pause("mode=keep") == 48, "a pause in keep mode dropped the cache"
    assert hits_after_pause("mode=abort&clear_cache=False") == 48, "clear_cache=False (any case) dropped the cache"
    assert hits_after_pause("mode=wait") == 0, "a pause in wait mode kept the cache (vLLM's default clears it)"
    status, body = server.request("POST", "/pause?mode=wait&clear_cache=maybe")
    assert status == 400 and "clear_cache" in body["error"]["message"], body
    assert server.get("/is_paused")[1] == {"is_paused": False}, "a refused pause paused the server"


def run_in_one_step(engine, requests: list[EngineRequest]) -> None:
    """Submit while paused, so that every request is admitted into the same step."""
    engine.set_paused(True)
    for request in requests:
        engine.submit(request)
    engine.set_paused(False)
    wait(requests)


def assert_logprobs_equal_a_full_forward(model, request: EngineRequest) -> None:
    for seq in request.sequences:
        expected = teacher_forced(model, request.prompt, seq.output, request.params)
        picked = expected[torch.arange(len(seq.output)), torch.tensor(seq.output)]
        served = torch.tensor(seq.logprobs)
        assert torch.equal(served, picked), (
            f"prompt of {len(request.prompt)} tokens drifts by {(served - picked).abs().max():.2e}"
        )


def test_cached_tails_and_whole_prompts_prefilled_together_match_a_full_forward(tiny_model):
    """One prefill batch mixing a prompt with a cached head (its pad columns run past the context) and fresh
    prompts; every log-prob stays bitwise that of a full forward."""
    engine = make_engine(max_model_len=128)
    try:
        rng = random.Random(11)
        head = random_prompt(rng, 60)
        run(engine, [EngineRequest(prompt=head, params=SamplingParams(max_tokens=4, seed=0))])
        hits = engine.stats().prefix_cache_hits_total
        requests = [
            EngineRequest(prompt=p, params=SamplingParams(temperature=1.0, max_tokens=12, seed=i))
            for i, p in enumerate([random_prompt(rng, 100), head + random_prompt(rng, 5), random_prompt(rng, 7)])
        ]
        run_in_one_step(engine, requests)
        assert engine.stats().prefix_cache_hits_total - hits == 48
        for request in requests:
            assert_logprobs_equal_a_full_forward(tiny_model, request)
    finally:
        engine.stop()


def test_requests_of_one_step_that_share_a_prefix_compute_it_once(tiny_model):
    """A group's rollouts sent as separate requests arrive together: the first prefills the shared prompt and the
    others, prefilled after it in the same step, find it cached (as in vLLM)."""
    engine = make_engine()
    try:
        rng = random.Random(5)
        shared = random_prompt(rng, 40)
        prompts = [shared + random_prompt(rng, 3) for _ in range(3)] + [random_prompt(rng, 40)]
        requests = [
            EngineRequest(prompt=p, params=SamplingParams(temperature=1.0, max_tokens=8, seed=i), n=2)
            for i, p in enumerate(prompts)
        ]
        run_in_one_step(engine, requests)
        assert engine.stats().prefix_cache_hits_total == 2 * 32, (
            "the second and third request reuse the first's two blocks"
        )
        for request in requests:
            assert_logprobs_equal_a_full_forward(tiny_model, request)
    finally:
        engine.stop()


def test_a_sequence_running_across_a_reset_stores_nothing():
    """Its KV may predate the new weights: only what is computed after the reset may be cached."""
    engine = make_engine()
    try:
        request = EngineRequest(prompt=list(range(3, 40)), params=SamplingParams(max_tokens=200, ignore_eos=True))
        engine.submit(request)
        while engine.stats().running == 0:
            time.sleep(0.001)
        engine.call(engine.reset_prefix_cache).result()
        wait([request])
        assert engine.stats().prefix_cache_tokens == 0
    finally:
        engine.stop()


def fake_row(tokens: list[int]):
    """A cache row whose KV at each position is that position's token id, shaped as SlotKVCache.read returns it."""
    return lambda start, stop: (
        torch.tensor(tokens[start:stop], dtype=torch.float32).view(1, 1, 1, -1, 1).expand(2, 1, 1, -1, 1)
    )


def test_lookups_match_whole_blocks_leave_the_last_token_and_keep_adapters_apart():
    cache = PrefixCache(max_tokens=64, block_size=4)
    tokens = list(range(10, 22))  # three blocks
    cache.store(tokens, "", fake_row(tokens))
    length, kv = cache.lookup(tokens, "")
    assert length == 8, "the last token is always computed, so its block is not matched"
    assert kv[0, 0, 0, :, 0].tolist() == tokens[:8]
    assert cache.lookup(tokens + [5], "")[0] == 12
    assert cache.lookup([99] + tokens, "")[0] == 0, "a block's hash covers every token before it"
    assert cache.lookup(tokens + [5], "adapter")[0] == 0, "another adapter never shares KV"
    assert (cache.queries, cache.hits) == (12 + 13 + 13 + 13, 20)


def test_the_cache_stays_within_its_bound_evicting_least_recently_used_blocks_tail_first():
    cache = PrefixCache(max_tokens=8, block_size=4)
    first, second = list(range(10, 22)), list(range(30, 38))
    cache.store(first, "", fake_row(first))
    assert cache.num_tokens == 8 and cache.lookup(first + [5], "")[0] == 8, "the chain's head is kept, its tail evicted"
    cache.store(second, "", fake_row(second))
    assert cache.num_tokens == 8
    assert cache.lookup(first + [5], "")[0] == 0 and cache.lookup(second + [5], "")[0] == 8
    cache.clear()
    assert cache.num_tokens == 0 and cache.lookup(second + [5], "")[0] == 0
