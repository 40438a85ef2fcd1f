"""An OpenEnv environment trained through its harness against real vLLM at staleness 0: the harness's every model call
is sampled by tandem from `vllm serve`, and the trainer scores exactly those tokens (examples/openenv_counter.py, its
counter environment and sessions as shipped)."""

import json
import sys
from pathlib import Path

from openenv.core.harness import MCPHarnessAdapter

from tandem import HarnessAsyncGRPOTrainer
from tests.vllm.conftest import TOKEN_GAP, assert_on_policy

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from openenv_counter import CounterSessions, config  # noqa: E402


def test_an_openenv_harness_trains_on_policy_against_vllm(tmp_path, vllm_server):
    steps = 6
    args = config(
        output_dir=str(tmp_path / "run"),
        max_steps=steps,
        max_staleness=0,
        vllm_server_base_url=vllm_server.url,
        weight_sync_check_atol=TOKEN_GAP,
        save_strategy="no",
        disable_tqdm=True,
    )
    HarnessAsyncGRPOTrainer(
        "tiny", harness_session_factory=CounterSessions(), harness_adapter=MCPHarnessAdapter(), args=args
    ).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert_on_policy(records, steps)
    assert any(r.get("tools/increment/call_count", 0) > 0 and r["rollout/turns_mean"] > 1 for r in records), (
        "the model called the environment's tool, over several turns"
    )
