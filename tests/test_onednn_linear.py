"""Large linear layers on oneDNN: nn.Linear's results to fp32 noise, on the weights of the moment, and the trainer's
layers rounding exactly as exact decoding's, a few rows against many."""

import pytest
import torch

from tandem.kernels import onednn_linear

pytestmark = pytest.mark.skipif(not onednn_linear.usable(torch.float32), reason="needs oneDNN and an x86 CPU")
exact_rows = pytest.mark.skipif(onednn_linear.EXACT_ROWS is None, reason="oneDNN's rows do not round alike here")


def with_routed_layers(*layers: torch.nn.Module, monkeypatch, exact: bool = False, reorder: bool = True):
    """`layers` in a Sequential, every one routed to oneDNN whatever its size."""
    monkeypatch.setattr(onednn_linear, "MIN_ELEMENTS", 0)
    model = torch.nn.Sequential(*layers)
    assert onednn_linear.install(model, exact=exact, reorder=reorder) == len(layers)
    return model


def test_a_routed_layer_computes_what_nn_linear_does_for_any_input_shape(monkeypatch):
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 40)
    model = with_routed_layers(torch.nn.Linear(96, 40), monkeypatch=monkeypatch)
    model[0].load_state_dict(plain.state_dict())
    for x in (torch.randn(7, 96), torch.randn(3, 5, 96), torch.randn(4, 9, 96)[:, -1:]):
        with torch.inference_mode():
            assert torch.allclose(model(x), plain(x), atol=1e-5), f"input of shape {tuple(x.shape)}"


def test_a_routed_layer_follows_its_weight_once_told(monkeypatch):
    model = with_routed_layers(torch.nn.Linear(16, 16, bias=False), monkeypatch=monkeypatch)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        before = model(x)
        model[0].weight.mul_(2)
        assert torch.equal(model(x), before), "the reordered copy is kept until forget()"
        onednn_linear.forget(model)
        assert torch.allclose(model(x), 2 * before, atol=1e-5)


@exact_rows
def test_exact_decodings_few_rows_round_as_the_trainers_many(monkeypatch):
    """The server decodes a few rows on a reordered copy, the trainer forwards hundreds passing the weight as it is:
    each row the same bits, from EXACT_ROWS rows on."""
    assert onednn_linear.EXACT_ROWS <= 4, "a few rows, not a padding that costs a decode step"
    torch.manual_seed(0)
    plain = torch.nn.Linear(2048, 192)
    server = with_routed_layers(torch.nn.Linear(2048, 192), monkeypatch=monkeypatch, exact=True, reorder=True)
    trainer = with_routed_layers(torch.nn.Linear(2048, 192), monkeypatch=monkeypatch, exact=True, reorder=False)
    for model in (server, trainer):
        model[0].load_state_dict(plain.state_dict())
    x = torch.randn(1, 333, 2048)  # one packed row
    trained = trainer(x)
    with torch.inference_mode():
        drifted = [
            rows
            for rows in [*range(onednn_linear.EXACT_ROWS, 17), 64]
            if not torch.equal(server(x[0, :rows].unsqueeze(1))[:, 0], trained[0, :rows])
        ]
    assert not drifted, f"the server's rows round unlike the trainer's at {drifted} rows"


def test_the_trainers_layers_take_nn_linears_gradients(monkeypatch):
    torch.manual_seed(0)
    plain = torch.nn.Linear(256, 96)
    trainer = with_routed_layers(torch.nn.Linear(256, 96), monkeypatch=monkeypatch, reorder=False)
    trainer[0].load_state_dict(plain.state_dict())
    x = torch.randn(3, 40, 256)
    x_trainer, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    trained, expected = trainer(x_trainer), plain(x_plain)
    assert torch.allclose(trained, expected, atol=1e-5)
    grad = torch.randn_like(trained)
    trained.backward(grad)
    expected.backward(grad)
    assert torch.allclose(x_trainer.grad, x_plain.grad, atol=1e-5), "the input's gradient"
    assert torch.allclose(trainer[0].weight.grad, plain.weight.grad, atol=1e-4), "the weight's gradient"
    assert torch.allclose(trainer[0].bias.grad, plain.bias.grad, atol=1e-4), "the bias's gradient"


def test_a_trainer_layers_output_may_be_changed_in_place_as_f_linears_may(monkeypatch):
    model = with_routed_layers(torch.nn.Linear(16, 8), monkeypatch=monkeypatch, reorder=False)
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = model(x)
    out.mul_(2)  # a view returned by a custom Function could not be: autograd refuses
    out.sum().backward()
    assert torch.allclose(model[0].bias.grad, torch.full((8,), 20.0))


def test_a_trainer_layer_computes_as_f_linear_when_compiled_autocast_or_moved(monkeypatch):
    """Inductor lowers oneDNN's call only for frozen weights, autocast's cast would be skipped, and oneDNN's call takes
    CPU float32 here: F.linear then. torch.compile's eager backend traces the same branch without code generation."""
    torch.manual_seed(0)
    model = with_routed_layers(torch.nn.Linear(512, 96), monkeypatch=monkeypatch, reorder=False)
    x = torch.randn(40, 512)  # 256 wide, one Sapphire Rapids machine summed alike on both
    with torch.no_grad():
        mkl = torch.nn.functional.linear(x, model[0].weight, model[0].bias)
        assert not torch.equal(model(x), mkl), (
            "oneDNN and MKL round apart on this input: the checks below can tell them"
        )
        assert torch.equal(torch.compile(model, backend="eager")(x), mkl)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(x).dtype == torch.bfloat16
        assert model.double()(x.double()).dtype == torch.float64


def test_small_layers_and_unsupported_bfloat16_stay_on_mkl_and_exact_takes_float32_only(monkeypatch):
    small = torch.nn.Sequential(torch.nn.Linear(192, 512))
    assert onednn_linear.install(small, exact=False, reorder=True) == 0, (
        "192 x 512 is under MIN_ELEMENTS: oneDNN's call costs more than it saves"
    )
    monkeypatch.setattr(onednn_linear, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # a CPU with AVX-512
    bfloat16 = torch.nn.Linear(8, 8).to(torch.bfloat16)
    assert onednn_linear.install(torch.nn.Sequential(bfloat16), exact=True, reorder=True) == 0, (
        "exact decoding's rounding is probed in float32 only"
    )
    assert onednn_linear.install(torch.nn.Sequential(bfloat16), exact=False, reorder=True) == 1
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # a CPU without AVX-512
    assert (
        onednn_linear.install(torch.nn.Sequential(torch.nn.Linear(8, 8).to(torch.bfloat16)), exact=False, reorder=True)
        == 0
    )
