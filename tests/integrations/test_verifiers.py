"""verifiers.v1 environments train unchanged: the environment object as train_dataset (or `dataset:
verifiers:<taskset id>` in a recipe), its episodes played in the rollout worker by its harness, every model call
sampled by tandem. The tasksets are examples/arithmetic_taskset (arithmetic, a calculator over MCP, a reward in Python) and a variant
with a broken scorer."""

import json
import sys
from pathlib import Path

import aiohttp
import pytest
import verifiers.v1 as vf
from verifiers.v1.errors import OverlongPromptError, model_error

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer, UsageError
from tandem.contract.records import TurnRecord
from tandem.integrations.verifiers import ENVIRONMENT, TASK, check_config
from tandem.integrations.verifiers_loop import Capture
from tandem.tasks import datasets
from tandem.tasks.tools import calculator

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def tasksets(monkeypatch):
    """The tasksets importable by id, here and in the worker (and in the tool servers verifiers starts from it)."""
    monkeypatch.syspath_prepend(str(HERE.parents[1] / "examples"))
    monkeypatch.syspath_prepend(str(HERE / "verifiers_tasks"))


def agent(**overrides) -> vf.AgentConfig:
    return vf.AgentConfig(
        **{"harness": {"id": "tandem_harness"}, "runtime": vf.SubprocessConfig(), "max_turns": 3, **overrides}
    )


def environment(taskset: str):
    return vf.load_environment(vf.SingleAgentEnvConfig(taskset={"id": taskset}, agent=agent()))


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_a_verifiers_environment_trains_through_the_worker_with_the_samplers_own_tokens(tmp_path):
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        num_generations=4,
        max_completion_length=32,
        max_staleness=0,
        learning_rate=1e-4,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = AsyncGRPOTrainer("tiny", args=args, train_dataset=environment("flaky_arithmetic"))
    assert trainer.train().global_step == 2
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert all("rewards/verifiers_reward/mean" in r for r in rows if "reward" in r), "the episode's reward, by name"
    assert any("rewards/correct/mean" in r for r in rows), "each of the environment's rewards is logged"
    assert any(r.get("tools/calculator/call_count", 0) > 0 for r in rows), "the harness ran the MCP tool"
    assert max(r.get("rollout/turns_max", 0) for r in rows) >= 2, "multi-turn: a reply after the tool's result"
    forks = [r["rollout/fork_frac"] for r in rows if "rollout/fork_frac" in r]
    assert forks and all(f == 0 for f in forks), "each turn extends the last: one sample a rollout"
    assert sum(r.get("env/failure_count", 0) for r in rows) > 0, "a scorer returning a non-number is counted, not fatal"
    for r in rows:  # staleness 0: the trainer scores exactly the tokens and log-probs the sampler produced
        assert r["sample/staleness_max"] == 0
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4


def test_a_recipe_names_a_taskset_and_gets_its_tasks_as_rows():
    rows = datasets.load("verifiers:arithmetic_taskset", options={"agent": {"max_turns": 2}})
    assert len(rows) == 128 and rows[0]["prompt"][0]["content"].startswith("What is")
    assert rows[0][TASK] == 0 and len(set(rows[ENVIRONMENT])) == 1, "every row names the one environment"


def test_a_misspelt_taskset_is_one_line_naming_it():
    with pytest.raises(UsageError, match="'verifiers:arithmetic_tasket'.*verifiers refused it"):
        datasets.load("verifiers:arithmetic_tasket")


@pytest.mark.parametrize(
    "overrides, refused",
    [
        ({"runtime": vf.PrimeConfig()}, "PrimeConfig runtime"),  # verifiers' default: a remote sandbox
        ({"harness": {"id": "claude_code"}}, "needs a container"),
    ],
)
def test_what_cannot_run_here_is_refused_by_name(overrides, refused):
    with pytest.raises(NotImplementedError, match=refused):
        check_config(vf.SingleAgentEnvConfig(taskset={"id": "arithmetic_taskset"}, agent=agent(**overrides)))


def test_a_plain_eval_dataset_beside_a_verifiers_environment_is_refused():
    with pytest.raises(UsageError, match="as train_dataset and as eval_dataset alike"):
        AsyncGRPOTrainer(
            "tiny",
            train_dataset=environment("arithmetic_taskset"),
            args=AsyncGRPOConfig(max_steps=1),
            eval_dataset=datasets.load("arithmetic-test"),
        )


def test_tools_beside_a_verifiers_environment_are_refused():
    with pytest.raises(UsageError, match="give the tools to the environment"):
        AsyncGRPOTrainer(
            "tiny",
            train_dataset=environment("arithmetic_taskset"),
            tools=[calculator],
            args=AsyncGRPOConfig(max_steps=1),
        )


async def test_the_capture_answers_as_verifiers_client_reads_and_refuses_a_prompt_past_the_context():
    async def sample(prompt_ids):
        return TurnRecord(
            prompt_ids=prompt_ids, output_ids=[7, 2], output_log_probs=[-0.5, -0.25], finish_reason="stop"
        )

    capture = Capture(sample, max_model_len=8)
    await capture.start()
    name = capture.open()
    try:
        async with aiohttp.ClientSession() as http:
            url = capture.url.removesuffix("/v1") + "/inference/v1/generate"
            async with http.post(url, json={"model": name, "token_ids": [1, 2, 3], "sampling_params": {}}) as answer:
                body = await answer.json()
            async with http.post(url, json={"model": name, "token_ids": list(range(9))}) as refused:
                too_long = (refused.status, (await refused.json())["error"]["message"])
            async with http.post(url, json={"model": "someone-else", "token_ids": [1]}) as unknown:
                unknown_status = unknown.status
    finally:
        await capture.stop()
    choice = body["choices"][0]
    assert (choice["token_ids"], body["prompt_token_ids"]) == ([7, 2], [1, 2, 3])
    assert choice["logprobs"]["content"] == [
        {"token": "token_id:7", "logprob": -0.5},
        {"token": "token_id:2", "logprob": -0.25},
    ]
    assert too_long[0] == 400 and isinstance(model_error(too_long[1]), OverlongPromptError), (
        "verifiers reads the refusal as a context-length stop, ending the episode cleanly"
    )
    assert unknown_status == 404
    assert [len(t.prompt_ids) for t in capture.close(name).turns] == [3], "the rollout keeps the turn it sampled"


def test_without_verifiers_installed_a_recipe_says_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as if verifiers were not installed
    with pytest.raises(UsageError, match=r"pip install 'tandem-rl\[verifiers\]'"):
        datasets.load("verifiers:arithmetic_taskset")
