"""Chunked log-probs equal the full log-softmax; models a tree row would change get padded rows, which are exact too."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3NextConfig

from tandem.kernels import exact_attention
from tandem.model import architecture
from tandem.packing import PADDED, TREE, pack
from tandem.packing import tree_attention as attention
from tandem.packing.log_probs import chunked_log_probs, default_chunk_size, plain_linear, row_log_probs
from tandem.tasks import TINY_MODEL_PATH
from tests.conftest import tiny_hybrid

from .samples import sample


def full_logprobs(hidden, head, targets, temperature=1.0, kept=None):
    logits = head(hidden).float() / temperature
    if kept is not None:
        mask = torch.full_like(logits, float("-inf"))
        for i, ids in enumerate(kept):
            mask[i, ids] = 0.0
        logits = logits + mask
    return logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_chunks_give_the_full_log_softmax_and_its_gradients(chunk_size):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 50, (40,))
    expected = full_logprobs(hidden, head, targets, temperature=0.7)
    expected.sum().backward()
    expected_grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    got = chunked_log_probs(hidden, head, targets, temperature=0.7, chunk_size=chunk_size)
    got.log_probs.sum().backward()
    torch.testing.assert_close(got.log_probs, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(hidden.grad, expected_grads[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(head.weight.grad, expected_grads[1], atol=1e-6, rtol=1e-5)
    probs = (head(hidden).float() / 0.7).softmax(-1)
    torch.testing.assert_close(got.entropy, -(probs * probs.log()).sum(-1), atol=1e-5, rtol=0)


class WrappedHead(torch.nn.Linear):
    """A head with a forward of its own (as a LoRA-wrapped one has): scored through autograd, chunk by chunk."""

    def forward(self, x):
        return super().forward(x)


@pytest.mark.parametrize("head_kind", [torch.nn.Linear, WrappedHead])
def test_every_option_gives_autograds_values_and_gradients(head_kind):
    torch.manual_seed(2)
    head = head_kind(16, 50, bias=True)
    assert plain_linear(head) == (head_kind is torch.nn.Linear), "a plain Linear takes the written-out backward"
    hidden = torch.randn(30, 16, requires_grad=True)
    kept = torch.stack([torch.randperm(50)[:12] for _ in range(30)])
    kept[::3, 8:] = -1  # shorter kept sets, padded
    targets, extra = kept[:, 0], kept[:, :4]  # the sampled token and the sampler's top 4, all in the kept set
    weight_target, weight_extra = torch.randn(30), torch.randn(30, 4)  # a loss that is not a plain sum

    logits = torch.tanh(head(hidden) / 30.0) * 30.0 / 0.7
    mask = torch.full_like(logits, float("-inf")).scatter(1, torch.where(kept >= 0, kept, kept[:, :1]), 0.0)
    every = (logits + mask).log_softmax(-1)
    (
        (every.gather(1, targets[:, None])[:, 0] * weight_target).sum() + (every.gather(1, extra) * weight_extra).sum()
    ).backward()
    expected = (
        every.gather(1, targets[:, None])[:, 0],
        hidden.grad.clone(),
        head.weight.grad.clone(),
        head.bias.grad.clone(),
    )
    hidden.grad = head.weight.grad = head.bias.grad = None

    got = chunked_log_probs(hidden, head, targets, 0.7, kept, softcap=30.0, chunk_size=7, extra_ids=extra)
    ((got.log_probs * weight_target).sum() + (got.extra * weight_extra).sum()).backward()
    torch.testing.assert_close(got.log_probs, expected[0], atol=1e-5, rtol=0)
    for name, grad, want in zip(
        ["hidden", "weight", "bias"], [hidden.grad, head.weight.grad, head.bias.grad], expected[1:]
    ):
        torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"d loss / d {name}: {m}")


def test_the_default_chunk_holds_64_mib_of_logits_within_its_bounds():
    assert default_chunk_size(32768) == 512
    assert default_chunk_size(512) == 1024, "a small vocabulary: no more rows than 1024"
    assert default_chunk_size(262144) == 64, "a huge vocabulary: no fewer rows than 64"


def test_kept_sets_renormalise_over_what_the_sampler_kept():
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 30, bias=False)
    hidden = torch.randn(5, 8)
    kept = [[3, 4, 5], [0], [7, 8, 9, 10], [1, 29], [2, 3]]
    targets = torch.tensor([k[-1] for k in kept])
    padded = torch.tensor([k + [-1] * (4 - len(k)) for k in kept])
    got = chunked_log_probs(hidden, head, targets, sampling_mask=padded, chunk_size=2)
    torch.testing.assert_close(got.log_probs, full_logprobs(hidden, head, targets, kept=kept), atol=1e-6, rtol=0)
    assert got.log_probs[1].item() == 0.0  # a kept set of one token: probability 1
    assert got.entropy[1].item() == 0.0


def test_kept_sets_that_include_token_zero_survive_padding():
    head = torch.nn.Linear(4, 6, bias=False)
    hidden = torch.randn(2, 4)
    padded = torch.tensor([[0, 2, -1], [5, -1, -1]])
    got = chunked_log_probs(hidden, head, torch.tensor([0, 5]), sampling_mask=padded)
    expected = full_logprobs(hidden, head, torch.tensor([0, 5]), kept=[[0, 2], [5]])
    torch.testing.assert_close(got.log_probs, expected, atol=1e-6, rtol=0)


def tiny_config(**overrides) -> Qwen2Config:
    values = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return Qwen2Config(**(values | overrides))


def test_the_exact_kernel_scores_each_branch_of_a_tree_bit_for_bit_as_the_branch_alone():
    """A tree row puts a group's later completions further along the row than the sampler's own sequence had them;
    the exact kernel's softmax and its values' matmul must not round with where a key sits (torch's softmax left them
    ~1e-6 apart, a 32-column values' matmul over 200+ keys ~1e-6 too). Bit for bit where MKL runs in its strict mode;
    elsewhere rows of other lengths round apart, within 1e-5."""
    allowed = 0.0 if exact_attention.ROWS_ROUND_ALIKE else 1e-5
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32).eval()
    attention.prepare(model)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 384, (230,), generator=generator).tolist()  # rows of 262 keys: MKL blocks 200+
    branches = [
        sample(prompt + torch.randint(3, 384, (8,), generator=generator).tolist(), [False] * 230 + [True] * 8)
        for _ in range(4)
    ]
    with torch.no_grad():
        tree = row_log_probs(model, pack(branches), "exact").log_probs.view(4, 8)
        alone = [row_log_probs(model, pack([branch]), "exact").log_probs for branch in branches]
    moved = [i for i in range(4) if (tree[i] - alone[i]).abs().max() > allowed]
    assert not moved, f"branches {moved} of the tree round unlike the same branch packed alone"


def test_sliding_window_layers_see_only_their_window_in_the_tree():
    torch.manual_seed(0)
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=3)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model = AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict(reference.state_dict())
    attention.prepare(model)
    samples = [sample([1, 2, 3, 4, 5, 6, 7, 8]), sample([1, 2, 3, 4, 9, 10, 11, 12, 13]), sample([20, 21, 22])]
    expected = []
    for s in samples:
        logits = reference(input_ids=torch.tensor([s.input_ids + [0] * (16 - s.num_tokens)])).logits[0]
        expected += [logits[j - 1].log_softmax(-1)[s.input_ids[j]] for j in range(1, s.num_tokens)]
    for kernel in ("exact", "sdpa"):
        got = row_log_probs(model, pack(samples), kernel).log_probs
        torch.testing.assert_close(got, torch.stack(expected).detach(), atol=1e-5, rtol=0)


def test_layers_that_scan_across_tokens_get_padded_rows():
    model = AutoModelForCausalLM.from_config(tiny_config())
    model.config.layer_types = ["full_attention", "linear_attention"]
    assert attention.padded_reasons(model) == ["linear_attention reads across tokens outside attention"]
    assert attention.prepare(model) == PADDED and model.config._attn_implementation != attention.NAME


def test_modules_that_scan_across_tokens_get_padded_rows():
    model = AutoModelForCausalLM.from_config(tiny_config())

    class MambaMixer(torch.nn.Module):
        pass

    model.model.layers[0].mixer = MambaMixer()
    assert attention.padded_reasons(model) == ["MambaMixer reads across tokens outside attention"]
    assert attention.prepare(model) == PADDED


def test_attention_sinks_and_soft_capped_scores_get_padded_rows():
    sinks = AutoModelForCausalLM.from_config(tiny_config())
    sinks.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    capped = AutoModelForCausalLM.from_config(
        Gemma2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    )
    assert [attention.prepare(m) for m in (sinks, capped)] == [PADDED, PADDED]
    assert (
        "sinks" in attention.padded_reasons(sinks)[0]
        and "attn_logit_softcapping" in attention.padded_reasons(capped)[0]
    )
    assert capped.config._attn_implementation == "eager", "gemma2 keeps the attention that soft-caps its scores"


def test_a_plain_attention_model_is_tree_packed():
    model = AutoModelForCausalLM.from_config(tiny_config())
    assert attention.prepare(model) == TREE and model.config._attn_implementation == attention.NAME


def test_padded_rows_of_a_hybrid_give_each_samples_own_forward_and_gradients():
    """Layers that scan every token before them (the layout of those tandem cannot tree-pack, such as Mamba; here a
    Gated DeltaNet hybrid through its own attention): a padded row (one sequence per sample, padding after it) gives
    each sample exactly what its own unpacked forward gives, shared prompt and all, and the same gradients."""
    model = tiny_hybrid()  # not prepared: the model's own layers and attention
    prompt = list(range(3, 40))
    samples = [
        sample(prompt + [50, 51, 52], [0] * 37 + [1, 1, 1]),
        sample(prompt + [60], [0] * 37 + [1], group=1),
        sample([7, 8, 9], [0, 1, 1], group=2),
    ]
    row = pack(samples, layout=PADDED)
    assert row.num_tokens == 3 * 40 and row.packing_ratio == 81 / 120, "padded to the longest sample, nothing shared"
    expected = []
    for s in samples:
        logits = model(input_ids=torch.tensor([s.input_ids])).logits[0]
        expected += [logits[j - 1].log_softmax(-1)[s.input_ids[j]] for j in range(1, s.num_tokens) if s.trained[j]]
    expected = torch.stack(expected)
    expected.sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    got = row_log_probs(model, row, "exact").log_probs
    got.sum().backward()
    torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_an_unknown_kernel_names_the_choices():
    model = AutoModelForCausalLM.from_config(tiny_config())
    with pytest.raises(ValueError, match="'exact', 'sdpa', 'flex'"):
        attention.tree_masks(torch.tensor([0]), torch.tensor([0]), model, "flash")


def test_moe_rows_return_the_router_load_balancing_loss_of_their_real_tokens():
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ids = list(range(3, 23))  # 20 tokens: no filler rows
    expected = model(input_ids=torch.tensor([ids])).aux_loss  # transformers' own (before router_aux_loss_coef)
    attention.prepare(model)
    scored = row_log_probs(model, pack([sample(ids)]), "exact")
    torch.testing.assert_close(scored.aux_loss, expected, atol=1e-6, rtol=1e-5)
    scored.aux_loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0, "the router gets the balancing gradient"


def tiny_qwen3_next() -> torch.nn.Module:
    """A Qwen3-Next-style hybrid (Gated DeltaNet with fused projections, then attention; experts in every MLP)."""
    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("make", [tiny_hybrid, tiny_qwen3_next], ids=["qwen3_5", "qwen3_next"])
def test_gated_deltanet_hybrids_are_tree_packed_each_branch_from_its_parents_state(make):
    """Tree packing for Gated DeltaNet hybrids: a group's completions share their prompt, each continuing
    the convolution window and recurrent state the prompt ended in; log-probs and gradients equal each sample's own
    forward to the chunked kernel's rounding (its 64-token chunks start where a segment starts)."""
    model = make()
    assert attention.prepare(model) == TREE and attention.padded_reasons(model) == []
    prompt = list(range(3, 73))  # past the kernel's first 64-token chunk
    samples = [sample(prompt + [100 + i, 101 + i, 102, 103 + i] * (i + 1), group=0) for i in range(3)]
    samples += [
        sample(prompt[:20] + [9, 9, 9], group=0),
        sample([7, 8, 9, 10, 11], group=1),
    ]  # a mid-prompt branch, a root
    row = pack(samples)
    assert row.layout == TREE and row.packing_ratio > 2
    expected = []
    for s in samples:
        ids = torch.tensor([s.input_ids])
        logits = model(input_ids=ids).logits[0, :-1]
        expected.append(logits.log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0])
    expected = torch.cat(expected)
    expected.sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    got = row_log_probs(model, row, "exact")
    order = torch.cat([torch.nonzero(row.term_sample == n)[:, 0] for n in range(len(samples))])
    torch.testing.assert_close(got.log_probs[order], expected.detach(), atol=2e-5, rtol=1e-5)
    got.log_probs.sum().backward()
    for name, grad in expected_grads.items():  # gradients of up to ~500 here: compared by norm
        difference = (dict(model.named_parameters())[name].grad - grad).norm()
        assert difference <= 1e-4 * grad.norm(), f"{name}: {difference:.2e} off a gradient of norm {grad.norm():.2e}"


def test_a_tree_rows_segments_end_where_another_branch_leaves():
    from tandem.packing.linear_attention import tree_scan

    # depth-first: a prompt of 4 tokens, two completions after it, a branch after its 2nd token, a second root
    scan = tree_scan([0, 1, 2, 3, 4, 5, 4, 2, 0, 1])
    assert scan.parents == [-1, 0, 1, 2, 3, 4, 3, 1, -1, 8]
    assert scan.segments == [(0, 2, -1), (2, 4, 1), (4, 6, 3), (6, 7, 3), (7, 8, 1), (8, 10, -1)]


def test_the_values_matmul_of_8_columns_at_a_time_is_the_plain_one_at_any_head_dim():
    torch.manual_seed(0)
    for dim in (8, 12, 32):
        weights = torch.rand(1, 2, 5, 30, requires_grad=True)
        value = torch.randn(1, 2, 30, dim, requires_grad=True)
        got = exact_attention.WeightedValues.apply(weights, value)
        expected = torch.matmul(weights, value)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
        grads = torch.autograd.grad(got.sum(), (weights, value))
        torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), (weights, value)), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "config, expected",
    [
        (LlamaConfig(), ("full_attention", None)),
        (MistralConfig(sliding_window=12), ("sliding_attention", 12)),
        (Qwen2Config(layer_types=["full_attention"] * 2, num_hidden_layers=2), ("full_attention", None)),
        (
            Gemma2Config(sliding_window=12, num_hidden_layers=2),
            {"sliding_attention": ("sliding_attention", 12), "full_attention": ("full_attention", None)},
        ),
    ],
    ids=["no layer types", "a window without layer types", "one layer type", "layer types that differ"],
)
def test_the_mask_goes_in_alone_unless_the_layer_types_differ(config, expected):
    """Only models whose layers attend differently read a dict of masks by layer type; one mask suits all the others
    (Llama's forward takes nothing else), windowed by `sliding_window` where a config sets one without layer types."""
    assert architecture.layer_masks(config, lambda layer_type, window: (layer_type, window)) == expected


def test_granite_logits_scaling_is_applied_before_the_temperature_forward_and_backward():
    torch.manual_seed(0)
    hidden, head = torch.randn(20, 8, requires_grad=True), torch.nn.Linear(8, 30, bias=False)
    targets = torch.randint(0, 30, (20,))
    got = chunked_log_probs(hidden, head, targets, 0.7, logits_scaling=8.0, chunk_size=7)
    expected = (head(hidden) / 8.0 / 0.7).log_softmax(-1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(got.log_probs, expected)
    (grad,) = torch.autograd.grad(got.log_probs.sum(), hidden)
    (expected_grad,) = torch.autograd.grad(expected.sum(), hidden)
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("kernel", ["exact", "sdpa"])
def test_bf16_autocast_trains_through_every_cpu_tree_kernel(kernel):
    """`bf16: true` on CPU runs the tree row under bf16 autocast; the exact kernel's backward computes in bf16 too."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    layout = attention.prepare(model)
    samples = [sample(list(range(3, 30)), group=0), sample(list(range(3, 20)) + [7, 8], group=0)]
    with torch.no_grad():
        full = row_log_probs(model, pack(samples, layout), kernel).log_probs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = row_log_probs(model, pack(samples, layout), kernel).log_probs
    half.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert (half - full).abs().max() < 0.02 * full.abs().max(), "bf16 log-probs far from fp32 (bf16 keeps ~3 digits)"
