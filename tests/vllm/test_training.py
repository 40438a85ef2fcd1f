"""Training against real vLLM at staleness 0 (full weights and tools into the session's first server, LoRA into the
second, whose base weights nothing changes): every sampled token's log-prob under the server must be the trainer's
(the sampler's log-probs are the behaviour policy: invariant 1 in docs/architecture.md), at every step, for each way
the policy reaches the server: full weights streamed (tandem's gloo plugin), a LoRA adapter per version, and
multi-turn tools."""

import json

from tests.vllm.conftest import TOKEN_GAP, assert_on_policy, run_tandem


def train(tmp_path, server, recipe: str, steps: int, *overrides: str) -> list[dict]:
    out = tmp_path / "run"
    done = run_tandem(
        "train",
        recipe,
        "--vllm_server_base_url",
        server.url,
        "--max_staleness",
        "0",
        "--max_steps",
        str(steps),
        "--output_dir",
        str(out),
        "--weight_sync_check_atol",
        str(TOKEN_GAP),
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "true",
        *overrides,
    )
    assert done.returncode == 0, f"tandem train {recipe} failed:\n{done.stderr[-3000:]}\nserver:\n{server.tail()}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_adapters_sync_on_policy_into_vllm(tmp_path, vllm_pair):
    # On the server no test trains full weights into: its base weights stay the tiny model's own, as the adapter's
    assert_on_policy(train(tmp_path, vllm_pair[1], "examples/lora.yaml", 30), 30)


def test_full_weights_stream_on_policy_into_vllm(tmp_path, vllm_server):
    assert_on_policy(train(tmp_path, vllm_server, "examples/demo.yaml", 30), 30)


def test_multi_turn_tool_rollouts_train_on_policy_against_vllm(tmp_path, vllm_server):
    records = train(tmp_path, vllm_server, "examples/tools.yaml", 12)
    assert_on_policy(records, 12)
    assert any(r["tools/calculator/call_count"] > 0 and r["rollout/turns_mean"] > 1 for r in records), (
        "the model called its tool, over several turns"
    )
