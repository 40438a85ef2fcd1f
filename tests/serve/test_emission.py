"""A step's logits become tokens, reported log-probs and finish reasons, as vLLM reports and stops them."""

import pytest
import torch

from tandem.serve.emission import Emission
from tandem.serve.requests import EngineRequest
from tandem.serve.sampling import SamplingParams

EMISSION = Emission("processed_logprobs", eos_token_id=5, extra_stop_token_ids=frozenset({4}), max_model_len=10)


def certain(token: int, rows: int = 1) -> torch.Tensor:
    """Logits under which `token` is all but certain, for `rows` rows."""
    logits = torch.full((rows, 6), -30.0)
    logits[:, token] = 0.0
    return logits


def step(request: EngineRequest, token: int, total: int = 3) -> str | None:
    (reason,) = EMISSION.emit([(request, request.sequences[0])], [total], certain(token), "default")
    return reason


def test_eos_ends_a_sequence_unless_ignored_and_a_stop_token_is_its_stop_reason():
    assert step(request := EngineRequest([1, 2], SamplingParams()), 5) == "stop"
    assert request.sequences[0].stop_reason is None and request.sequences[0].output == [5]
    assert step(EngineRequest([1, 2], SamplingParams(ignore_eos=True)), 5) is None
    assert step(request := EngineRequest([1, 2], SamplingParams(stop_token_ids=[3])), 3) == "stop"
    assert request.sequences[0].stop_reason == 3
    assert step(request := EngineRequest([1, 2], SamplingParams()), 4) == "stop"  # the model's extra stop tokens
    assert request.sequences[0].stop_reason == 4


def test_max_tokens_and_the_model_length_end_a_sequence_for_length():
    assert step(EngineRequest([1, 2], SamplingParams(max_tokens=1)), 0) == "length"
    assert step(EngineRequest([1, 2], SamplingParams(max_tokens=5)), 0, total=10) == "length"
    request = EngineRequest([1, 2], SamplingParams(max_tokens=5))
    assert step(request, 0) is None and request.sequences[0].checked == 1, "a running sequence's token is checked"


def test_the_sampled_token_comes_first_in_its_top_entries_with_its_rank():
    request = EngineRequest([1, 2], SamplingParams(logprobs=2, temperature=1.0, seed=0))
    logits = torch.tensor([[2.0, 1.0, -30.0, -30.0, -30.0, -30.0]])
    EMISSION.emit([(request, request.sequences[0])], [3], logits, "default")
    seq = request.sequences[0]
    (entries,) = seq.top_logprobs
    ranks = {0: 1, 1: 2}  # by logit
    assert entries[0] == (seq.output[0], seq.logprobs[0], ranks[seq.output[0]]), "the sampled token, first"
    assert [(token, rank) for token, _, rank in entries[1:]] == [(t, r) for t, r in ranks.items() if t != seq.output[0]]


def test_an_unknown_logprobs_mode_is_refused_naming_the_modes():
    with pytest.raises(ValueError, match=r"logprobs_mode='raw' is not one of \('raw_logprobs'"):
        Emission("raw", 5, frozenset(), 10)
