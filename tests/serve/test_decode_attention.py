"""Fast decoding's grouped attention computes what transformers' SDPA path computes, from the engine's cache views."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tandem.serve.decode_attention import MAX_QUERY_ROWS, decode_attention


class Layer(torch.nn.Module):
    """What the attention functions read off a model's attention layer."""

    num_key_value_groups = 3
    is_causal = True


def inputs(q_len: int, value_dim: int = 16):
    """A decode window of `q_len` queries for 5 sequences, 12 query heads over 4 key-value heads, keys read as views of
    a larger cache (as SlotKVCache hands them out), each sequence with its own number of keys attended."""
    generator = torch.Generator().manual_seed(q_len)
    keys, values = (
        torch.randn(2, 8, 4, 96, 16, generator=generator),
        torch.randn(2, 8, 4, 96, value_dim, generator=generator),
    )
    key, value = keys[0, :5, :, :70], values[1, :5, :, :70]
    query = torch.randn(5, 12, q_len, 16, generator=generator)
    lengths = torch.tensor([70, 41, 12, 66, 3 + q_len])
    positions = lengths[:, None] - q_len + torch.arange(q_len)
    mask = torch.arange(70)[None, None, :] <= positions[:, :, None]
    return query, key, value, mask[:, None]


def both(query, key, value, mask, layer=None) -> tuple[torch.Tensor, torch.Tensor]:
    """tandem_decode's output and transformers' SDPA path's, for the same inputs."""
    layer = layer or Layer().eval()
    ours, weights = decode_attention(layer, query, key, value, mask, scaling=0.25)
    assert weights is None
    return ours, sdpa_attention_forward(layer, query, key, value, mask, scaling=0.25)[0]


@pytest.mark.parametrize("q_len", [1, 3])
def test_a_decode_window_attends_as_sdpa_does(q_len):
    ours, theirs = both(*inputs(q_len))
    assert ours.shape == theirs.shape == (5, q_len, 12, 16)
    assert torch.allclose(ours, theirs, atol=1e-6), f"largest gap {(ours - theirs).abs().max():.2e}"


def test_values_narrower_than_the_keys():
    ours, theirs = both(*inputs(1, value_dim=8))
    assert ours.shape == theirs.shape == (5, 1, 12, 8) and torch.allclose(ours, theirs, atol=1e-6)


def test_a_row_that_attends_to_nothing_gets_zeros_as_from_sdpa():
    query, key, value, mask = inputs(1)
    mask[2] = False
    ours, theirs = both(query, key, value, mask)
    assert torch.equal(ours[2], torch.zeros_like(ours[2])) and torch.equal(theirs[2], ours[2])
    assert torch.allclose(ours, theirs, atol=1e-6), "the other rows as before"


def fallbacks():
    """Inputs tandem_decode leaves to SDPA: a longer window, bfloat16, a float mask, one mask per head, a mask
    broadcast over the window's queries, no mask."""
    query, key, value, mask = inputs(MAX_QUERY_ROWS + 1)
    yield "prefill window", (query, key, value, mask)
    query, key, value, mask = inputs(1)
    yield "bfloat16", (query.bfloat16(), key.bfloat16(), value.bfloat16(), mask)
    yield "float mask", (query, key, value, torch.zeros(mask.shape).masked_fill(~mask, float("-inf")))
    yield "a mask per head", (query, key, value, mask.expand(-1, 12, -1, -1))
    query, key, value, mask = inputs(3)
    yield "mask broadcast over queries", (query, key, value, mask[:, :, -1:])
    yield "no mask", (query, key, value, None)


@pytest.mark.parametrize("case", [name for name, _ in fallbacks()])
def test_what_it_leaves_to_sdpa_is_sdpas_answer(case):
    ours, theirs = both(*dict(fallbacks())[case])
    assert torch.equal(ours, theirs)


def test_training_goes_to_sdpa():
    ours, theirs = both(*inputs(1), layer=Layer().train())
    assert torch.equal(ours, theirs)
