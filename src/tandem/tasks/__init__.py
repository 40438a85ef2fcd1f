"""Built-in tasks and the project's tiny model, used by the demo and the tests."""

from pathlib import Path

TINY_MODEL_PATH = str(Path(__file__).parent / "tiny_model")
"""The shipped tiny Qwen2-architecture model (built by scripts/build_tiny_model.py)."""


def scaled_tiny(hidden: int, layers: int, dtype=None, **kwargs):
    """The tiny model's architecture at another size, random weights, built from its config (nothing downloaded): heads
    of 32 dimensions, a third as many key-value heads, an MLP 8/3 as wide (hidden 768, 12 layers: 76M parameters).
    For benchmarks and tests; torch and transformers are imported here, so that importing tasks stays light."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(TINY_MODEL_PATH, **kwargs)
    config.hidden_size, config.intermediate_size = hidden, hidden * 8 // 3
    config.num_attention_heads, config.num_key_value_heads = hidden // 32, hidden // 96
    config.num_hidden_layers, config.layer_types = layers, ["full_attention"] * layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
