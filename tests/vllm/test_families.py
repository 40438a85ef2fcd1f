"""The model-family matrix's Llama against real vLLM (its CPU build): served by a `vllm serve` of its own folder and
trained at staleness 0, every token's log-prob within the tier's bound of the trainer's, through a LoRA adapter per
version and through full weights streamed over tandem's gloo plugin.

Qwen3-MoE is not here yet. vLLM 0.32's CPU build serves it within 4.8e-7 of transformers until a weight stream. After
a stream, even of the same weights under the checkpoint's names, it serves 0.067 off. With `--enable-lora` it runs the
experts through a Triton kernel that has no CPU backend: the engine dies at the first request."""

import pytest

from tests.conftest import saved_with_tiny_tokenizer
from tests.families.catalog import BY_NAME
from tests.vllm.conftest import FLAGS, REPO, VllmServer, assert_on_policy, require_environment
from tests.vllm.test_training import train

STEPS = 4
REWARD = "[tests.trainer.test_trainer.varied_reward]"
"""Random weights solve no arithmetic: a reward that differs within every group, so each step trains."""


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    """A vLLM server of the matrix's random Llama, saved with the tiny tokenizer: (its folder, the server)."""
    require_environment()
    folder = saved_with_tiny_tokenizer(BY_NAME["Llama"].build(), tmp_path_factory.mktemp("llama"))
    server = VllmServer(tmp_path_factory.mktemp("vllm") / "server.log", *FLAGS,
                        command=[str(REPO / "scripts" / "vllm_serve.sh"), folder]).launch()
    try:
        yield folder, server.wait()
    finally:
        server.kill()


def test_a_lora_adapter_syncs_on_policy_into_vllm(tmp_path, llama_server):
    """First on its server: the adapter sits on the checkpoint's base weights, which the full-weight run then changes."""
    folder, server = llama_server
    records = train(tmp_path, server, "examples/demo.yaml", STEPS, "--model", folder, "--reward_funcs", REWARD,
                    "--lora", "{r: 4, lora_alpha: 8, lora_dropout: 0.0, target_modules: all-linear}")
    assert_on_policy(records, STEPS)


def test_full_weights_stream_on_policy_into_vllm(tmp_path, llama_server):
    folder, server = llama_server
    records = train(tmp_path, server, "examples/demo.yaml", STEPS, "--model", folder, "--reward_funcs", REWARD)
    assert_on_policy(records, STEPS)
