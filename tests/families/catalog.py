"""The model families tandem is tested on: a small random-weight model built from each transformers config class
(nothing downloaded), with the tiny model's vocabulary and tokenizer. Each config sets what tells its family apart —
sliding windows with and without `layer_types`, latent attention, expert routing, tied and untied heads, scaled
logits — so the matrix (test_families.py) meets it. docs/models.md is generated from this list:
`python -m tests.families.catalog > docs/models.md`."""

from dataclasses import dataclass, field

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

WINDOW = 12
"""Sliding windows shorter than the tests' prompts, so that they apply."""
DIMS = dict(
    vocab_size=512,
    hidden_size=192,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    eos_token_id=2,
    pad_token_id=0,
    bos_token_id=1,
)
"""The tiny model's proportions (192 wide, heads of 32, 3 query heads per key-value head). Narrower random models (64
wide) round ~3e-6 apart between exact decoding and the trainer's rows: their matmuls take other kernels."""
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=64)
ATTENTION_ONLY = ["q_proj", "k_proj", "v_proj", "o_proj"]
"""LoRA targets of the MoE families for now: an adapter on the fused expert layers (what peft's "all-linear" wraps)
syncs under names the server does not have (`experts.base_layer.down_proj`), an open fault."""
EXPERT_ROWS = (
    "an expert's matmuls see only the tokens routed to it, in a decode step often one row, which CPU "
    "matmuls round on another path than the trainer's many (seen: 4.8e-7)"
)


@dataclass(frozen=True)
class Family:
    name: str
    config: str
    """The transformers config class."""
    kwargs: dict
    exercises: str
    """What this config sets that the others do not, in a few words."""
    padded: str = ""
    """Why it trains on padded rows (empty: tree-packed)."""
    served_gap: float = 0.0
    """How far `tandem serve`'s exact log-probs may sit from the trainer's (0.0: bit for bit)."""
    why_gap: str = ""
    lora_targets: str | list[str] = "all-linear"
    """What the matrix's LoRA adapter targets (peft's `target_modules`)."""
    vision: dict = field(default_factory=dict)
    """A vision-language model's vision config (its `kwargs` are then its text config)."""

    def build(self) -> torch.nn.Module:
        """The model, random weights drawn from a fixed seed."""
        torch.manual_seed(0)
        config_class = getattr(transformers, self.config)
        if self.vision:
            config = config_class(text_config=self.kwargs, vision_config=self.vision, image_token_id=500)
            return AutoModelForImageTextToText.from_config(config).eval()
        return AutoModelForCausalLM.from_config(config_class(**self.kwargs)).eval()


def dims(**overrides) -> dict:
    return {**DIMS, **overrides}


FAMILIES = [
    Family("Llama", "LlamaConfig", dims(), "untied head"),
    Family("Mistral", "MistralConfig", dims(sliding_window=WINDOW), "sliding window without `layer_types`"),
    Family(
        "Mixtral",
        "MixtralConfig",
        dims(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
        "experts, load-balancing loss, sliding window without `layer_types`",
        served_gap=1e-6,
        why_gap=EXPERT_ROWS,
        lora_targets=ATTENTION_ONLY,
    ),
    Family(
        "Qwen2",
        "Qwen2Config",
        dims(
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=WINDOW,
            layer_types=["full_attention", "sliding_attention"],
        ),
        "tied head, one full and one sliding layer (a mask per layer type)",
    ),
    Family("Qwen3", "Qwen3Config", dims(head_dim=32), "query and key norms"),
    Family(
        "Qwen2-MoE",
        "Qwen2MoeConfig",
        dims(num_experts=4, shared_expert_intermediate_size=64, **MOE),
        "experts with a shared expert",
        served_gap=1e-6,
        why_gap=EXPERT_ROWS,
        lora_targets=ATTENTION_ONLY,
    ),
    Family(
        "Qwen3-MoE",
        "Qwen3MoeConfig",
        dims(head_dim=32, num_experts=4, use_sliding_window=True, sliding_window=WINDOW, **MOE),
        "experts, sliding window without `layer_types`",
        served_gap=1e-6,
        why_gap=EXPERT_ROWS,
        lora_targets=ATTENTION_ONLY,
    ),
    Family(
        "Gemma 2",
        "Gemma2Config",
        dims(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=32),
        "soft-capped attention scores and logits, alternating sliding layers",
        padded="soft-capped attention scores, which the tree kernels do not compute",
        served_gap=1e-6,
        why_gap="it keeps its own eager attention, whose softmax sums by position: a decode step's few keys round "
        "apart from the trainer's padded row (seen: 9.5e-7)",
    ),
    Family(
        "Gemma 3",
        "Gemma3TextConfig",
        dims(
            head_dim=32,
            sliding_window=WINDOW,
            query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "sliding and full layers, each with its own rotary base",
    ),
    Family(
        "Phi-3",
        "Phi3Config",
        dims(sliding_window=WINDOW),
        "fused query-key-value and gate-up projections, sliding window without `layer_types`",
    ),
    Family("OLMo 2", "Olmo2Config", dims(), "norms after attention and MLP, query and key norms"),
    Family(
        "Granite",
        "GraniteConfig",
        dims(logits_scaling=8.0, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.03),
        "logits divided by `logits_scaling`, scaled embeddings, residuals and attention",
    ),
    Family(
        "SmolLM3",
        "SmolLM3Config",
        dims(tie_word_embeddings=True, no_rope_layers=[1, 0]),
        "a layer without rotary positions",
    ),
    Family(
        "StableLM", "StableLmConfig", dims(partial_rotary_factor=0.25), "rotary positions on a quarter of each head"
    ),
    Family(
        "DeepSeek-V3",
        "DeepseekV3Config",
        dims(
            num_key_value_heads=6,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=24,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            **MOE,
        ),
        "latent attention (keys 48 wide, values 24), experts balanced without a loss",
        served_gap=1e-6,
        why_gap=EXPERT_ROWS,
        lora_targets=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    ),
    Family(
        "GPT-NeoX",
        "GPTNeoXConfig",
        {k: v for k, v in dims().items() if k != "num_key_value_heads"},
        "no `num_key_value_heads`, fused query-key-value, parallel residual",
    ),
    Family(
        "GPT-2",
        "GPT2Config",
        dict(
            vocab_size=512,
            n_embd=192,
            n_layer=2,
            n_head=6,
            n_positions=1024,
            eos_token_id=2,
            bos_token_id=1,
            pad_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        "learned absolute positions, Conv1D layers, no `num_key_value_heads`",
    ),
    Family(
        "Qwen3.5 hybrid",
        "Qwen3_5TextConfig",
        dims(
            head_dim=32,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"],
            tie_word_embeddings=True,
        ),
        "gated DeltaNet layers beside full attention",
        served_gap=1e-5,
        why_gap="exact decoding forwards each sequence whole, whose recurrent scan runs over "
        "fewer tokens than the trainer's row: its chunked sums round apart (~4e-6)",
    ),
    Family(
        "Qwen2.5-VL",
        "Qwen2_5_VLConfig",
        dims(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}),
        "a vision tower beside the language model (text only)",
        vision=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=192, fullatt_block_indexes=[0]
        ),
    ),
]
BY_NAME = {family.name: family for family in FAMILIES}


def table() -> str:
    """docs/models.md."""
    lines = [
        "# Supported model families",
        "",
        "Every family below is tested in `tests/families/test_families.py` on a small random-weight model built "
        "from its transformers config (2 layers, the tiny model's 512-token vocabulary and tokenizer). For each one:",
        "",
        "- the trainer's packed log-probs equal each sample's own forward (tree-packed unless said otherwise);",
        "- `tandem serve --decode-mode exact` samples the log-probs the trainer computes, bit for bit unless a "
        "bound is given;",
        "- a run trains two steps at `max_staleness 0` with gradient checkpointing on, syncing full weights, and "
        "another syncs a LoRA adapter; each step's importance ratio is 1 within that bound.",
        "",
        "A model outside this list loads the same way; what tandem cannot serve or pack is refused when it loads, "
        "saying what to do instead. A model whose config drops units in training (GPT-2's config defaults to "
        "0.1) is warned of: its training forward is then not the policy the server samples from, and "
        "the warning gives the `model_init_kwargs` that set the rates to 0 (the matrix's GPT-2 sets them).",
        "",
        "This page is generated: `python -m tests.families.catalog > docs/models.md`.",
        "",
        "| family | config | what its test model exercises | rows | served log-probs | LoRA targets |",
        "|---|---|---|---|---|---|",
    ]
    for f in FAMILIES:
        rows = f"padded: {f.padded}" if f.padded else "tree-packed"
        served = "bit for bit" if not f.served_gap else f"within {f.served_gap:g}: {f.why_gap}"
        targets = (
            f.lora_targets
            if isinstance(f.lora_targets, str)
            else "attention only: LoRA on the fused expert "
            "weights (what all-linear reaches) is refused when the trainer is built, as no server is synced such an adapter yet"
        )
        lines.append(f"| {f.name} | `{f.config}` | {f.exercises} | {rows} | {served} | {targets} |")
    lines += [
        "",
        "## Tool calls",
        "",
        "Each family writes tool calls in its own format. `tool_call_parser` (the rollout loop) and `tandem serve "
        "--tool-call-parser` (the chat endpoint) take vLLM's parser names and read the same calls vLLM does: "
        "`hermes` (Qwen 2.5 / 3, Hermes, SmolLM3), `llama3_json` (Llama 3.1 - 3.3), `mistral` (Mistral and "
        "Mixtral tokenizers before v11), `deepseek_v3` (DeepSeek-V3, R1), `granite` (Granite 3.0 / 3.1) and "
        "`pythonic` (Llama 3.2 / 4). A parser whose tokens the tokenizer lacks is refused at start.",
        "",
        "## Against `vllm serve`",
        "",
        "The `vllm` tier (`tests/vllm/test_families.py`) trains the matrix's Llama and Qwen3-MoE against a `vllm "
        "serve` of their folders (vLLM's CPU build, fp32) at `max_staleness 0`, streaming full weights, and "
        "Llama also syncing a LoRA adapter: the served log-probs stay within 1e-6 of the trainer's. vLLM's CPU "
        "experts pack their weights into a grouped-GEMM layout on the first load only (`fused_moe/experts/"
        "cpu_moe.py`), and a weight update writes checkpoint-layout values into that storage "
        "(`unquantized_fused_moe_method.py`, `_setup_kernel`): tandem's vLLM plugin packs them again after each "
        "update (without it a random Qwen3-MoE was served 0.067 off after a stream of the very weights it held). "
        "An MoE's LoRA cannot be served by the CPU build: started with `--enable-lora`, it runs the experts' "
        "adapters through Triton, which it lacks, and its engine dies at the first request.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
