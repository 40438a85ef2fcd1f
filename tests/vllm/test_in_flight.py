"""In-flight weight updates against real vLLM, which labels no token with the weights that sampled it: the trainer's
sync marks when each version began to be served, the tokens are streamed, and each is labelled by when it arrived.
A generation with a sync in its middle shows the labels true token by token: each token's log-prob under vLLM is the
trainer's forward under the weights its label names (vLLM's pause drops the running sequences' caches, computed again
under the new weights when generation resumes)."""

import asyncio
import concurrent.futures
import json
import multiprocessing as mp
import time
import urllib.request

import torch
from transformers import AutoModelForCausalLM

from tandem.contract.channels import ServedVersions, versions_at
from tandem.generation.client import Completion, ControlClient, GenerationClient
from tandem.runtime.weight_transfer import GlooPlane, TransferSync
from tandem.tasks import TINY_MODEL_PATH
from tests.conftest import chat_prompt
from tests.runtime.test_weight_transfer import trained_model
from tests.vllm.conftest import TOKEN_GAP, run_tandem

TOKENS = 900
"""The generation's length (the tiny model's context is 1024); the sync starts once 100 tokens were generated, the rest
take seconds more (vLLM's CPU build: 3-10 ms a token), and the sync half a second."""


def generated_tokens(server) -> float:
    """vLLM's count of the tokens it generated since it started (its /metrics)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as answer:
        lines = answer.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("vllm:generation_tokens_total"))


def wait_for_tokens(server, count: int, timeout_s: float = 120) -> None:
    """Until vLLM has generated `count` more tokens. Asked four times a second: rendering /metrics takes vLLM's front
    long enough that asking it every 20 ms held its streams back, and they arrived in one burst at the end."""
    start, end = generated_tokens(server), time.monotonic() + timeout_s
    while generated_tokens(server) - start < count:
        assert time.monotonic() < end, f"vLLM generated fewer than {count} tokens in {timeout_s:.0f}s"
        time.sleep(0.25)


def first_weights() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)


def log_probs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Each output token's log-prob under `model` (float64 from its float32 logits)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return logits.double().log_softmax(-1).gather(1, torch.tensor(output)[:, None])[:, 0]


def generate_across_a_sync(server, prompt: list[int], first, pushed) -> tuple[Completion, list[int]]:
    """A streamed generation of TOKENS tokens from `first`, with `pushed` synced in once 100 were generated; the
    completion and its tokens' versions (0: first, 1: pushed). Tried again (up to 3 times) when the sync missed the
    generation's middle: on a loaded machine the whole generation may finish in one of vLLM's stalls."""
    served = ServedVersions(mp.get_context("spawn"))

    async def generate() -> Completion:  # as the rollout worker asks under in_flight_weight_updates
        async with GenerationClient(server.url) as client:
            [completion] = await client.complete(
                prompt, max_tokens=TOKENS, ignore_eos=True, seed=1, model=TINY_MODEL_PATH, stream=True
            )
            return completion

    with asyncio.Runner() as run, concurrent.futures.ThreadPoolExecutor(1) as pool:
        control = ControlClient(server.url)
        plane = GlooPlane(stages=False)  # as choose_sync makes it for vLLM
        sync = TransferSync(control, run, TINY_MODEL_PATH, timeout_s=120, plane=plane, checkpoint_names=True)
        sync.connect()
        for _ in range(3):
            sync.push(first, 0, served.mark)  # the tiny model's own weights (a training test may have pushed others)
            answer = pool.submit(asyncio.run, generate())
            wait_for_tokens(server, 100)
            sync.push(pushed, 1, served.mark)
            completion = answer.result(timeout=300)
            versions = versions_at(served.timeline(), completion.arrivals, floor=0)
            if 0 < versions.count(1) < TOKENS - 1:
                break
        sync.push(first, 2)  # leave the server as the session found it
        run.run(control.close())
    return completion, versions


def test_a_sync_in_the_middle_of_a_vllm_generation_labels_each_token_with_the_weights_that_sampled_it(
    vllm_server, tokenizer
):
    prompt = chat_prompt(tokenizer, "Count to fifty.")
    first, pushed = first_weights(), trained_model(seed=1)
    completion, versions = generate_across_a_sync(vllm_server, prompt, first, pushed)
    assert len(completion.token_ids) == TOKENS and 1 in versions, f"the sync came after the generation: {versions}"
    swapped = versions.index(1)
    assert 1 < swapped and versions == [0] * swapped + [1] * (TOKENS - swapped), versions
    output = completion.token_ids
    expected = torch.cat([log_probs(first, prompt, output)[:swapped], log_probs(pushed, prompt, output)[swapped:]])
    gaps = (torch.tensor(completion.logprobs, dtype=torch.float64) - expected).abs()
    assert gaps[:swapped].max() <= TOKEN_GAP, f"a token before the sync is not the first weights': {gaps[:swapped]}"
    assert gaps[swapped:].max() <= TOKEN_GAP, (
        f"a token after the sync (at {swapped} of {TOKENS}) is not the pushed weights': {gaps[swapped:]}"
    )


def test_in_flight_weight_updates_train_against_vllm_within_the_token_rule(tmp_path, vllm_server):
    """A demo run with in_flight_weight_updates: vLLM's tokens are streamed and labelled, and no group trains past
    max_staleness by its tokens' mean version."""
    out = tmp_path / "run"
    settings = "--in_flight_weight_updates true --max_staleness 1 --max_completion_length 64 --temperature 1.5"
    run = "--max_steps 12 --save_strategy no --disable_tqdm true"
    done = run_tandem(
        "train", "examples/demo.yaml", "--vllm_server_base_url", vllm_server.url, "--output_dir", str(out),
        *settings.split(), *run.split(),
    )  # fmt: skip
    assert done.returncode == 0, f"tandem train failed:\n{done.stderr[-3000:]}\nserver:\n{vllm_server.tail()}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "sample/token_lag_mean" in r]
    assert len(rows) == 12
    for r in rows:
        assert r["sample/token_lag_mean"] <= 1, f"a group trained past max_staleness by its tokens: {r}"
        assert r["sample/token_lag_max"] <= r["sample/staleness_max"], "a token is never older than its group's start"
        assert r["sample/mixed_tokens_frac"] == 0, "vLLM computes a running sequence's cache again at each sync"
    assert any(r["sample/token_lag_mean"] < r["sample/staleness_mean"] for r in rows), (
        "no token was labelled with a version newer than its group's start: vLLM's stream labels were never used"
    )
