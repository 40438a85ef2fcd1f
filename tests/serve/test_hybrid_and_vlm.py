"""`tandem serve`'s engine over a gated DeltaNet hybrid (no prefix cache, a state per sequence) and over a
vision-language model (its language model, text only): sampled log-probs equal a teacher-forced forward."""

import logging
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config

from tandem.serve.engine import Engine
from tandem.serve.requests import EngineRequest
from tandem.serve.sampling import SamplingParams
from tests.conftest import tiny_hybrid, tiny_vlm
from tests.serve.test_engine import random_prompt, run, teacher_forced


def sampled(model: torch.nn.Module, exact: bool) -> tuple[Engine, list[EngineRequest]]:
    """A busy batch through a fresh engine over `model`: prompts shorter and longer than 16 tokens, groups of three."""
    rng = random.Random(0)
    engine = Engine(model, eos_token_id=2, max_model_len=256, logprobs_mode="processed_logprobs", exact=exact)
    engine.start()
    requests = [
        EngineRequest(
            prompt=random_prompt(rng, length),
            n=n,
            params=SamplingParams(temperature=0.9, max_tokens=12, seed=i, logprobs=2),
        )
        for i, (length, n) in enumerate([(5, 3), (30, 1), (70, 2), (12, 1)])
    ]
    try:
        run(engine, requests)
    finally:
        engine.stop()
    return engine, requests


def gaps(model: torch.nn.Module, requests: list[EngineRequest]) -> list[float]:
    """Per sequence, the largest |sampled log-prob - teacher-forced log-prob| of its tokens."""
    result = []
    for request in requests:
        for seq in request.sequences:
            expected = teacher_forced(model, request.prompt, seq.output, request.params)
            picked = expected[torch.arange(len(seq.output)), torch.tensor(seq.output)]
            result.append(float((torch.tensor(seq.logprobs) - picked).abs().max()))
    return result


def test_a_hybrid_decodes_exactly_by_forwarding_each_sequence_whole_with_no_prefix_cache(caplog):
    """Exact mode forwards each sequence whole, in the chunked form the trainer's forward takes: what is left is the
    rounding of a forward over a shorter sequence (3.8e-6 here; the one-token recurrent update drifts 2.7e-5)."""
    model = tiny_hybrid()
    with caplog.at_level(logging.WARNING, logger="tandem.serve"):
        engine, requests = sampled(model, exact=True)
    assert engine.prefix_cache is None and "prefix caching is off" in caplog.text and "linear_attention" in caplog.text
    assert max(gaps(model, requests)) < 1e-5
    assert all(len(seq.output) == 12 or seq.finish_reason == "stop" for r in requests for seq in r.sequences)


def test_a_hybrid_decodes_fast_through_transformers_own_cache():
    """Fast mode: one token at a time through the recurrent update, which rounds apart from the chunked form."""
    model = tiny_hybrid()
    _, requests = sampled(model, exact=False)
    assert max(gaps(model, requests)) < 1e-4


def test_exact_decoding_keeps_the_attention_of_a_model_that_soft_caps_its_scores():
    """tandem_exact computes plain softmax(QK^T)V: a Gemma 2 keeps its own eager attention, soft-capping included."""
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        attn_logit_softcapping=0.5,
        query_pre_attn_scalar=1,
        initializer_range=0.2,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    _, requests = sampled(model, exact=True)
    assert model.config._attn_implementation == "eager"
    assert max(gaps(model, requests)) < 1e-5


@pytest.mark.parametrize("exact", [True, False])
def test_a_vision_language_model_serves_its_language_model(exact):
    model = tiny_vlm()
    engine, requests = sampled(model, exact=exact)
    assert engine.prefix_cache is not None, "pure attention: prefix caching stays on"
    assert max(gaps(model, requests)) < (1e-5 if exact else 1e-4)
