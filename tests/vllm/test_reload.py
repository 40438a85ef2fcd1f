"""Full weights into vLLM through a folder it reloads (no weight-transfer engine): exact for a model whose LM head is its
own weight; refused at connect for a tied one on vLLM's CPU build, which keeps a packed copy of the old LM head (the
cause of the off-policy drift the plugin's stream fixes)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.tasks import TINY_MODEL_PATH
from tests.vllm.conftest import ENV_DIR, TOKEN_GAP, VllmServer, assert_on_policy, require_environment, run_tandem


@pytest.fixture(scope="module")
def untied_server(tmp_path_factory):
    """The tiny model with its LM head untied (a copy of the embedding), served by vLLM with no weight-transfer engine."""
    require_environment()
    folder = tmp_path_factory.mktemp("untied") / "model"
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_MODEL_PATH).save_pretrained(folder)
    command = [
        str(ENV_DIR / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--served-model-name",
        str(folder),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--logprobs-mode",
        "processed_logprobs",
        "--max-num-batched-tokens",
        "131072",
    ]
    server = VllmServer(
        folder.parent / "server.log", command=command, env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    ).launch()
    try:
        yield server.wait(), str(folder)
    finally:
        server.kill()


def test_an_untied_model_reloads_on_policy_into_vllm(tmp_path, untied_server):
    server, model = untied_server
    out = tmp_path / "run"
    done = run_tandem(
        "train",
        "examples/demo.yaml",
        "--model",
        model,
        "--vllm_server_base_url",
        server.url,
        "--max_staleness",
        "0",
        "--max_steps",
        "10",
        "--weight_sync_check_atol",
        str(TOKEN_GAP),
        "--output_dir",
        str(out),
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "true",
    )
    assert done.returncode == 0, f"{done.stderr[-3000:]}\nserver:\n{server.tail()}"
    assert_on_policy([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], 10)
    assert [p.name for p in (out / ".weights").glob("v*")] == ["v10"], "synced through a folder vLLM reloaded"


def test_a_tied_model_is_refused_a_reload_into_vllms_cpu_build(tmp_path, untied_server):
    server, _ = untied_server
    done = run_tandem(
        "train",
        "examples/demo.yaml",
        "--vllm_server_base_url",
        server.url,
        "--max_steps",
        "2",
        "--output_dir",
        str(tmp_path / "run"),
    )
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "does not refresh a tied LM head" in last and '"backend": "gloo"' in last and "Traceback" not in done.stderr
