"""Large linear layers on oneDNN: nn.Linear's results to fp32 noise, on the weights of the moment, and the trainer's
layers rounding exactly as the server's."""

import pytest
import torch

from tandem import onednn_linear

pytestmark = pytest.mark.skipif(not onednn_linear.usable(torch.float32), reason="needs oneDNN and an x86 CPU")


def routed(*layers: torch.nn.Module, monkeypatch, reorder: bool = True) -> torch.nn.Sequential:
    monkeypatch.setattr(onednn_linear, "MIN_ELEMENTS", 0)
    model = torch.nn.Sequential(*layers)
    assert onednn_linear.install(model, exact=False, reorder=reorder) == len(layers)
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


def test_the_trainers_layers_round_as_the_servers_and_take_nn_linears_gradients(monkeypatch):
    """The trainer passes the weight as it is, the server a reordered copy: the same bits. The backward is nn.Linear's."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(256, 96)
    server = routed(torch.nn.Linear(256, 96), monkeypatch=monkeypatch)
    trainer = routed(torch.nn.Linear(256, 96), monkeypatch=monkeypatch, reorder=False)
    for model in (server, trainer):
        model[0].load_state_dict(plain.state_dict())
    x = torch.randn(3, 40, 256)
    with torch.inference_mode():
        assert torch.equal(trainer(x), server(x))
    x_trainer, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    trained, expected = trainer(x_trainer), plain(x_plain)
    assert torch.allclose(trained, expected, atol=1e-5)
    grad = torch.randn_like(trained)
    trained.backward(grad)
    expected.backward(grad)
    assert torch.allclose(x_trainer.grad, x_plain.grad, atol=1e-5), "the input's gradient"
    assert torch.allclose(trainer[0].weight.grad, plain.weight.grad, atol=1e-4), "the weight's gradient"
    assert torch.allclose(trainer[0].bias.grad, plain.bias.grad, atol=1e-4), "the bias's gradient"


@pytest.mark.skipif(onednn_linear.EXACT_ROWS is None, reason="oneDNN's rows do not round alike here")
def test_rows_round_as_in_a_long_matmul_from_exact_rows_on():
    """Exact decoding forwards a few rows a step, the trainer thousands: each row rounds alike from EXACT_ROWS on."""
    assert onednn_linear.EXACT_ROWS <= 4, "a few rows, not a padding that costs a decode step"
    torch.manual_seed(0)
    weight, inputs = torch.randn(192, 2048) * 0.02, torch.randn(1024, 2048)
    long = onednn_linear.linear(inputs, weight)
    counts = [*range(onednn_linear.EXACT_ROWS, 17), 64, 333]
    drifted = [rows for rows in counts if not torch.equal(onednn_linear.linear(inputs[:rows], weight), long[:rows])]
    assert not drifted, f"rows round unlike a 1024-row matmul at {drifted} rows (EXACT_ROWS {onednn_linear.EXACT_ROWS})"


def test_small_layers_and_unsupported_bfloat16_stay_on_mkl_and_exact_takes_float32_only(monkeypatch):
    small = torch.nn.Sequential(torch.nn.Linear(192, 512))
    assert onednn_linear.install(small, exact=False, reorder=True) == 0, \
        "192 x 512 is under MIN_ELEMENTS: oneDNN's call costs more than it saves"
    monkeypatch.setattr(onednn_linear, "MIN_ELEMENTS", 0)
    assert onednn_linear.install(torch.nn.Sequential(torch.nn.Linear(8, 8).to(torch.bfloat16)), exact=True,
                                 reorder=True) == 0, "exact decoding's rounding is probed in float32 only"
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # a CPU without AVX-512
    assert onednn_linear.install(torch.nn.Sequential(torch.nn.Linear(8, 8).to(torch.bfloat16)), exact=False,
                                 reorder=True) == 0


def test_a_compiled_trainer_layer_computes_as_f_linear(monkeypatch):
    """Inductor lowers oneDNN's call only for frozen weights, so a compiled decoder's layers take F.linear (a compiled
    decoder rounds apart from exact decoding anyway). The eager backend traces the same branch without code generation."""
    torch.manual_seed(0)
    model = routed(torch.nn.Linear(256, 96), monkeypatch=monkeypatch, reorder=False)
    x = torch.randn(40, 256)
    with torch.no_grad():
        mkl = torch.nn.functional.linear(x, model[0].weight, model[0].bias)
        assert not torch.equal(model(x), mkl), "oneDNN and MKL round apart on this input: the check below can tell them"
        assert torch.equal(torch.compile(model, backend="eager")(x), mkl)


def test_a_trainer_layers_output_may_be_changed_in_place_as_f_linears_may(monkeypatch):
    model = routed(torch.nn.Linear(16, 8), monkeypatch=monkeypatch, reorder=False)
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = model(x)
    out.mul_(2)  # a view returned by a custom Function could not be: autograd refuses
    out.sum().backward()
    assert torch.allclose(model[0].bias.grad, torch.full((8,), 20.0))
