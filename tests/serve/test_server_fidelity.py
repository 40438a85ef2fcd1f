"""End to end through HTTP: served log-probs, top-N entries and sampling masks equal a teacher-forced forward."""

import concurrent.futures
import random

import pytest
import torch

from tandem.kernels import onednn_linear
from tandem.serve import decode_attention
from tandem.serve.requests import EngineRequest
from tandem.serve.sampling import SamplingParams
from tests.conftest import chat_prompt
from tests.serve.test_engine import make_engine, run, teacher_forced


def test_completion_logprobs_and_top_entries_match_inside_a_busy_batch(server, tiny_model, tokenizer):
    prompts = [chat_prompt(tokenizer, f"What is {a} + {b}?") for a, b in [(3, 4), (55, 21), (90, 9), (12, 70)] * 4]
    bodies = [
        {
            "prompt": p,
            "max_tokens": 10,
            "temperature": 0.8,
            "top_p": 0.95,
            "logprobs": 5,
            "seed": i,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        for i, p in enumerate(prompts)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: server.post("/v1/completions", b), bodies))
    for body, (status, answer) in zip(bodies, answers):
        assert status == 200
        choice = answer["choices"][0]
        expected = teacher_forced(
            tiny_model, body["prompt"], choice["token_ids"], SamplingParams(temperature=0.8, top_p=0.95)
        )
        for position, (_token, entries) in enumerate(zip(choice["token_ids"], choice["logprobs"]["top_logprobs"])):
            for key, value in entries.items():
                reference = max(float(expected[position, int(key.removeprefix("token_id:"))]), -9999.0)
                assert abs(value - reference) < 1e-5, f"position {position}, {key}: served {value}, forward {reference}"


def test_generate_sampling_masks_match_the_kept_support(mask_server, tiny_model, tokenizer):
    prompt = chat_prompt(tokenizer, "What is 40 + 2?")
    status, answer = mask_server.post(
        "/inference/v1/generate",
        {
            "token_ids": prompt,
            "sampling_params": {
                "max_tokens": 8,
                "temperature": 1.0,
                "top_k": 6,
                "top_p": 0.9,
                "logprobs": 0,
                "seed": 5,
                "ignore_eos": True,
            },
        },
    )
    assert status == 200
    choice = answer["choices"][0]
    expected = teacher_forced(tiny_model, prompt, choice["token_ids"], SamplingParams(top_k=6, top_p=0.9))
    for position, (mask, entry) in enumerate(zip(choice["sampling_mask"], choice["logprobs"]["content"])):
        assert mask == torch.isfinite(expected[position]).nonzero().flatten().tolist()
        assert abs(entry["logprob"] - float(expected[position, entry["token_id"]])) < 1e-5


def test_same_seed_same_tokens_alone_and_inside_a_busy_batch(server, tokenizer):
    body = {
        "prompt": chat_prompt(tokenizer, "What is 17 + 25?"),
        "max_tokens": 12,
        "seed": 77,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    alone = server.post("/v1/completions", body)[1]["choices"][0]["token_ids"]
    rng = random.Random(0)
    noise = [
        {"prompt": [rng.randrange(3, 384) for _ in range(rng.randrange(5, 60))], "max_tokens": rng.randrange(5, 40)}
        for _ in range(24)
    ]
    with concurrent.futures.ThreadPoolExecutor(25) as pool:
        futures = [pool.submit(server.post, "/v1/completions", b) for b in noise[:12] + [body] + noise[12:]]
        busy = futures[12].result()[1]["choices"][0]["token_ids"]
    assert busy == alone


def fast_drift(requests: list[EngineRequest], reference) -> float:
    """The largest gap between served log-probs and `reference`'s teacher-forced ones."""
    return max(
        float(
            (
                torch.tensor(r.sequences[0].logprobs)
                - teacher_forced(reference, r.prompt, r.sequences[0].output, r.params)[
                    torch.arange(len(r.sequences[0].output)), torch.tensor(r.sequences[0].output)
                ]
            )
            .abs()
            .max()
        )
        for r in requests
    )


def sdpa_tiny_model():
    from transformers import AutoModelForCausalLM

    from tandem.tasks import TINY_MODEL_PATH

    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32, attn_implementation="sdpa").eval()


def test_fast_mode_stays_within_fp32_noise_of_the_forward(monkeypatch):
    """Fast mode (grouped decode attention, SDPA for prefill, linear layers on oneDNN's reordered weights on a CPU)
    rounds differently from a full forward; it must stay close."""
    monkeypatch.setattr(onednn_linear, "MIN_ELEMENTS", 0)  # the tiny model's layers too
    engine = make_engine(attention="sdpa")
    assert engine.model.config._attn_implementation == decode_attention.NAME, "a CPU model decodes with tandem_decode"
    try:
        rng = random.Random(3)
        requests = [
            EngineRequest(
                prompt=[rng.randrange(3, 384) for _ in range(20)], params=SamplingParams(max_tokens=16, seed=i)
            )
            for i in range(8)
        ]
        run(engine, requests)
    finally:
        engine.stop()
    worst = fast_drift(requests, sdpa_tiny_model())
    assert worst < 1e-4, f"fast mode drifts {worst:.2e} from the forward"


@pytest.mark.skipif(
    not onednn_linear.usable(torch.float32), reason="oneDNN's matmul needs an x86 CPU and a torch with it"
)
def test_fast_mode_serves_weights_changed_in_place(monkeypatch):
    """A weight update (a sync, reload_weights) copies into the served parameters; the copies fast mode reorders for
    oneDNN must follow them (Engine.weights_changed)."""
    monkeypatch.setattr(onednn_linear, "MIN_ELEMENTS", 0)  # the tiny model's layers too
    engine, reference = make_engine(attention="sdpa"), sdpa_tiny_model()
    assert hasattr(engine.model.lm_head, "onednn_weight"), "a CPU model in fast mode computes with oneDNN"
    try:
        run(engine, [EngineRequest(prompt=[5, 6, 7], params=SamplingParams(max_tokens=2))])  # reorders the weights
        with torch.no_grad():
            for model in (engine.model, reference):
                for parameter in model.parameters():
                    parameter.mul_(1.25)
        engine.call(engine.weights_changed).result(60)
        rng = random.Random(4)
        requests = [
            EngineRequest(
                prompt=[rng.randrange(3, 384) for _ in range(20)], params=SamplingParams(max_tokens=8, seed=i)
            )
            for i in range(4)
        ]
        run(engine, requests)
    finally:
        engine.stop()
    worst = fast_drift(requests, reference)
    assert worst < 1e-4, f"fast mode serves {worst:.2e} away from the updated weights"


def test_echo_scores_random_prompts_as_a_teacher_forced_forward_then_the_generated_tokens(server, tiny_model):
    """How evaluation harnesses get log-likelihoods: `echo` + `logprobs` gives the prompt's log-probs (the first
    null) followed by the generated ones, each the forward's log-prob of that token given what precedes it."""
    rng = random.Random(0)
    vocab = tiny_model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 40))] for _ in range(5)]
    status, answer = server.post(
        "/v1/completions",
        {
            "prompt": prompts,
            "echo": True,
            "logprobs": 2,
            "max_tokens": 3,
            "temperature": 1.0,
            "seed": 3,
            "return_token_ids": True,
        },
    )
    assert status == 200
    for prompt, choice in zip(prompts, answer["choices"]):
        tokens = prompt + choice["token_ids"]
        scores = choice["logprobs"]["token_logprobs"]
        assert len(scores) == len(tokens) and scores[0] is None and choice["logprobs"]["top_logprobs"][0] is None
        with torch.no_grad():
            forward = (
                tiny_model(torch.tensor([tokens + [0] * max(0, 16 - len(tokens))])).logits[0].float().log_softmax(-1)
            )
        expected = forward[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
        gap = (torch.tensor(scores[1:]) - expected).abs().max().item()
        assert gap < 1e-5, f"a {len(prompt)}-token prompt: echoed log-probs differ from the forward by {gap}"
        assert all(len(top) in (2, 3) for top in choice["logprobs"]["top_logprobs"][1:]), "the token, then the top 2"
        assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(prompt)
