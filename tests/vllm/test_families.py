"""The model-family matrix's Llama and Qwen3-MoE against real vLLM (its CPU build): served by a `vllm serve` of their
own folders and trained at staleness 0, every token's log-prob within the tier's bound of the trainer's, through full
weights streamed over tandem's gloo plugin, and for Llama through a LoRA adapter per version.

Qwen3-MoE's experts run on vLLM's CPU kernels, whose packed weights a weight update leaves unpacked unless tandem's
plugin packs them again (it does; without that the run stops at its first trained sync, 0.067 off). Its LoRA is not
here: vLLM's CPU build runs an MoE's adapters through Triton, which it lacks, and its engine dies at the first
request."""

import pytest

from tests.conftest import saved_with_tiny_tokenizer
from tests.families.catalog import BY_NAME
from tests.vllm.conftest import FLAGS, REPO, VllmServer, assert_on_policy, require_environment
from tests.vllm.test_training import train

STEPS = 4
REWARD = "[tests.trainer.test_trainer.varied_reward]"
"""Random weights solve no arithmetic: a reward that differs within every group, so each step trains."""


def family_server(tmp_path_factory, name: str, flags=FLAGS):
    """A vLLM server of the matrix's random `name`, saved with the tiny tokenizer: (its folder, the server)."""
    require_environment()
    folder = saved_with_tiny_tokenizer(BY_NAME[name].build(), tmp_path_factory.mktemp(name.replace(" ", "_")))
    server = VllmServer(
        tmp_path_factory.mktemp("vllm") / "server.log",
        *flags,
        command=[str(REPO / "scripts" / "vllm_serve.sh"), folder],
    ).launch()
    try:
        yield folder, server.wait()
    finally:
        server.kill()


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    yield from family_server(tmp_path_factory, "Llama")


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    """Without LoRA: vLLM's CPU build runs an MoE's adapters through Triton, which it lacks (its engine dies)."""
    yield from family_server(tmp_path_factory, "Qwen3-MoE", flags=FLAGS[FLAGS.index("--max-logprobs") :])


def test_a_lora_adapter_syncs_on_policy_into_vllm(tmp_path, llama_server):
    """First on its server: the adapter sits on the checkpoint's base weights, which the full-weight run then changes."""
    folder, server = llama_server
    records = train(
        tmp_path,
        server,
        "examples/demo.yaml",
        STEPS,
        "--model",
        folder,
        "--reward_funcs",
        REWARD,
        "--lora",
        "{r: 4, lora_alpha: 8, lora_dropout: 0.0, target_modules: all-linear}",
    )
    assert_on_policy(records, STEPS)


def test_full_weights_stream_on_policy_into_vllm(tmp_path, llama_server):
    folder, server = llama_server
    records = train(tmp_path, server, "examples/demo.yaml", STEPS, "--model", folder, "--reward_funcs", REWARD)
    assert_on_policy(records, STEPS)


def test_full_weights_stream_on_policy_into_vllms_cpu_experts(tmp_path, moe_server):
    folder, server = moe_server
    records = train(tmp_path, server, "examples/demo.yaml", STEPS, "--model", folder, "--reward_funcs", REWARD)
    assert_on_policy(records, STEPS)
