"""Fast decoding's linear layers on oneDNN: the same results as nn.Linear to fp32 noise, on the weights of the moment."""

import pytest
import torch

from tandem.generation import onednn_linear

pytestmark = pytest.mark.skipif(not onednn_linear.usable(torch.float32), reason="needs oneDNN and an x86 CPU")


def routed(*layers: torch.nn.Module, monkeypatch) -> torch.nn.Sequential:
    monkeypatch.setattr(onednn_linear, "MIN_ELEMENTS", 0)
    model = torch.nn.Sequential(*layers)
    assert onednn_linear.install(model) == len(layers)
    return model


def test_a_routed_layer_computes_what_nn_linear_does_for_any_input_shape(monkeypatch):
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 40)
    model = routed(torch.nn.Linear(96, 40), monkeypatch=monkeypatch)
    model[0].load_state_dict(plain.state_dict())
    for x in (torch.randn(7, 96), torch.randn(3, 5, 96), torch.randn(4, 9, 96)[:, -1:]):
        with torch.inference_mode():
            assert torch.allclose(model(x), plain(x), atol=1e-5), f"input of shape {tuple(x.shape)}"


def test_a_routed_layer_follows_its_weight_once_told(monkeypatch):
    model = routed(torch.nn.Linear(16, 16, bias=False), monkeypatch=monkeypatch)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        before = model(x)
        model[0].weight.mul_(2)
        assert torch.equal(model(x), before), "the reordered copy is kept until forget()"
        onednn_linear.forget(model)
        assert torch.allclose(model(x), 2 * before, atol=1e-5)


def test_small_layers_and_unsupported_bfloat16_stay_on_mkl(monkeypatch):
    small = torch.nn.Sequential(torch.nn.Linear(192, 512))
    assert onednn_linear.install(small) == 0, "192 x 512 is under MIN_ELEMENTS: oneDNN's call costs more than it saves"
    monkeypatch.setattr(onednn_linear, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # a CPU without AVX-512
    assert onednn_linear.install(torch.nn.Sequential(torch.nn.Linear(8, 8).to(torch.bfloat16))) == 0
