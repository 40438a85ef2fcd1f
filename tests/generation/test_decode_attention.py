"""Fast decoding's grouped attention computes what transformers' SDPA path computes, from the engine's cache views."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tandem.generation.decode_attention import MAX_QUERY_ROWS, decode_attention


class Layer(torch.nn.Module):
    """What the attention functions read off a model's attention layer."""
    num_key_value_groups = 3
    is_causal = True


def inputs(q_len: int, dtype=torch.float32):
    """A decode window of `q_len` queries for 5 sequences, 12 query heads over 4 key-value heads, keys read as views of
    a larger cache (as SlotKVCache hands them out), each sequence with its own number of keys attended."""
    generator = torch.Generator().manual_seed(q_len)
    cache = torch.randn(2, 8, 4, 96, 16, generator=generator).to(dtype)
    key, value = cache[0, :5, :, :70], cache[1, :5, :, :70]
    query = torch.randn(5, 12, q_len, 16, generator=generator).to(dtype)
    lengths = torch.tensor([70, 41, 12, 66, 3 + q_len])
    positions = lengths[:, None] - q_len + torch.arange(q_len)
    mask = torch.arange(70)[None, None, :] <= positions[:, :, None]
    return query, key, value, mask[:, None]


@pytest.mark.parametrize("q_len", [1, 3])
def test_a_decode_window_attends_as_sdpa_does(q_len):
    query, key, value, mask = inputs(q_len)
    ours, weights = decode_attention(Layer().eval(), query, key, value, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(Layer().eval(), query, key, value, mask, scaling=0.25)
    assert weights is None and ours.shape == theirs.shape == (5, q_len, 12, 16)
    assert torch.allclose(ours, theirs, atol=1e-6), f"largest gap {(ours - theirs).abs().max():.2e}"


def test_in_bfloat16_the_softmax_runs_in_float32():
    query, key, value, mask = inputs(1, torch.bfloat16)
    ours, _ = decode_attention(Layer().eval(), query, key, value, mask, scaling=0.25)
    exact, _ = decode_attention(Layer().eval(), query.float(), key.float(), value.float(), mask, scaling=0.25)
    assert ours.dtype == torch.bfloat16 and torch.allclose(ours.float(), exact, atol=2e-2)


def test_longer_windows_and_training_go_to_sdpa():
    query, key, value, mask = inputs(MAX_QUERY_ROWS + 1)
    theirs, _ = sdpa_attention_forward(Layer().eval(), query, key, value, mask, scaling=0.25)
    assert torch.equal(decode_attention(Layer().eval(), query, key, value, mask, scaling=0.25)[0], theirs)
    query, key, value, mask = inputs(1)
    theirs, _ = sdpa_attention_forward(Layer().eval(), query, key, value, mask, scaling=0.25)
    assert torch.equal(decode_attention(Layer().train(), query, key, value, mask, scaling=0.25)[0], theirs)
