"""One failure is not fatal: a reward function that raises, or a request the server fails, costs at most its group;
a mistake in the user's code stops the run at once, naming it. The rollout loop runs in-process here, its replies
scripted and its messages read from real channels."""

import asyncio
import multiprocessing as mp
import time

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from tandem import AsyncGRPOConfig, AsyncRolloutLoop, TurnRecord
from tandem.contract.channels import Channels
from tandem.generation.client import ServerError, ServerGone
from tandem.rollout.scheduler import FAILED_IN_A_ROW
from tandem.rollout.settings import RolloutSettings
from tandem.rollout.worker import stop_message
from tandem.runtime.weight_transfer import free_port
from tandem.tasks import TINY_MODEL_PATH

TOKENIZER = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)


class ScriptedLoop(AsyncRolloutLoop):
    """Every rollout replies with its own index in the group, so each group's rewards vary; prompts listed in
    `failing_requests` get a 500 from the "server" that many times."""

    failing_requests: dict[str, int] = {}
    slow_until_synced: str | None = None
    """A prompt whose first request is slow, and during which the trainer syncs a new policy."""

    async def generate_one_turn(self, prompt_ids):
        text = TOKENIZER.decode(prompt_ids)
        if self.slow_until_synced and self.slow_until_synced in text:
            self.slow_until_synced = None
            self._scheduler.channels.model_version.value += 1
            await asyncio.sleep(5)
        for prompt, left in self.failing_requests.items():
            if prompt in text and left:
                self.failing_requests[prompt] -= 1
                raise ServerError(500, "EngineCore encountered an issue", "http://server/v1/completions")
        self.replies = getattr(self, "replies", 0) + 1
        ids = TOKENIZER.encode(str(self.replies % 2), add_special_tokens=False) + [TOKENIZER.eos_token_id]
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=ids, output_log_probs=[-0.5] * len(ids))


def run_loop(
    reward,
    prompts: int = 6,
    failing_requests=None,
    slow_until_synced=None,
    loop_cls=ScriptedLoop,
    settings: dict | None = None,
    timeout_s: float | None = None,
    **config,
) -> tuple[list, dict]:
    """Run the loop over `prompts` prompts until it says "end" (or `timeout_s` passes); returns its messages and its
    metrics merged. `settings` overrides RolloutSettings fields (another dataset, a resumed run's start)."""
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"prompt {i}"}]} for i in range(prompts)])
    settings = RolloutSettings(
        **{
            "config": AsyncGRPOConfig(
                num_generations=2, max_completion_length=8, **{"train_sampling_strategy": "sequential", **config}
            ),
            "model_name": "tiny",
            "tokenizer_path": TINY_MODEL_PATH,
            "dataset": dataset,
            "reward_funcs": [reward],
            "eos_token_ids": [TOKENIZER.eos_token_id],
            "base_url": "http://127.0.0.1:9",
            "num_prompts": prompts,
            "full_step_tokens": 10_000,
            **(settings or {}),
        }
    )
    channels = Channels.create(mp.get_context("spawn"))
    loop = loop_cls(settings, processing_class=TOKENIZER, channels=channels)
    loop.failing_requests = dict(failing_requests or {})
    loop.slow_until_synced = slow_until_synced
    loop._scheduler.control.max_retries = 0  # there is no server to ask for /metrics: give up at once

    async def main():
        task = asyncio.ensure_future(loop.run())
        messages = []
        while not messages or messages[-1][0] != "end":
            while channels.out.empty():
                if task.done():
                    task.result()  # the loop's own error
                await asyncio.sleep(0.01)
            messages.append(channels.out.get())
            if messages[-1][0] == "samples":  # the trainer takes them: room for the next groups
                channels.consumed_tokens.value += sum(s.num_tokens for s in messages[-1][1])
                channels.room.ring()
        channels.stop.set()
        await task
        return messages

    messages = asyncio.run(asyncio.wait_for(main(), timeout_s))
    metrics: dict[str, list] = {}
    for kind, payload in messages:
        if kind == "metrics":
            for name, values in payload.items():
                metrics.setdefault(name, []).extend(values)
    return messages, metrics


def prompt_indices(messages, kind):
    return sorted(
        p.prompt_index if kind == "samples" else p
        for k, payload in messages
        if k == kind
        for p in (payload if kind == "samples" else [payload])
    )


def by_reply(completions, **kwargs):
    return [float(c[0]["content"]) for c in completions]


class FlakyOnce:
    """A judge over the network: its first call fails."""

    def __init__(self):
        self.calls = 0

    def __call__(self, completions, **kwargs):
        self.calls += 1
        if self.calls == 1:
            raise ConnectionResetError("judge connection reset")
        return by_reply(completions)


def test_a_reward_function_that_fails_once_is_called_again_and_nothing_is_lost():
    messages, metrics = run_loop(FlakyOnce())
    assert sorted(set(prompt_indices(messages, "samples"))) == list(range(6))
    assert "rollout/failed_count" not in metrics


def fails_on_prompt_3(prompts, completions, **kwargs):
    if "prompt 3" in prompts[0][0]["content"]:
        raise ValueError("cannot parse the answer of prompt 3")
    return by_reply(completions)


def test_a_reward_function_that_fails_twice_on_a_group_drops_that_group_only(capsys):
    messages, metrics = run_loop(fails_on_prompt_3)
    assert sorted(set(prompt_indices(messages, "samples"))) == [0, 1, 2, 4, 5]
    assert prompt_indices(messages, "skip") == [3] and sum(metrics["rollout/failed_count"]) == 1
    assert (
        "dropped the group of prompt 3: reward function 'fails_on_prompt_3' failed (it failed on the group, "
        "and again when called once more: ValueError: cannot parse the answer of prompt 3)"
    ) in capsys.readouterr().err


def always_fails(completions, **kwargs):
    raise KeyError("score")


def test_a_reward_function_that_keeps_failing_stops_the_run_naming_it_with_its_traceback():
    with pytest.raises(
        RuntimeError,
        match=f"(?s){FAILED_IN_A_ROW} groups in a row were dropped because reward function "
        "'always_fails' failed.*Traceback.*in always_fails.*KeyError: 'score'",
    ):
        run_loop(always_fails, prompts=10)


def slow_reward(completions, **kwargs):
    time.sleep(0.3)
    return by_reply(completions)


def test_a_reward_function_past_reward_timeout_counts_as_a_failure():
    with pytest.raises(
        RuntimeError, match="reward function 'slow_reward' failed.*no answer within reward_timeout=0.05s"
    ):
        run_loop(slow_reward, prompts=10, reward_timeout=0.05)


def test_a_request_the_server_fails_regenerates_its_group_once_then_drops_it():
    messages, metrics = run_loop(by_reply, failing_requests={"prompt 1": 1, "prompt 4": 100})
    assert sorted(set(prompt_indices(messages, "samples"))) == [0, 1, 2, 3, 5], "prompt 1 failed once: generated again"
    assert prompt_indices(messages, "skip") == [4] and sum(metrics["rollout/failed_count"]) == 1, (
        "prompt 4 failed every time: dropped after its second try"
    )


def test_a_group_that_can_only_arrive_stale_is_cancelled_and_generated_again_under_the_new_policy():
    start = time.monotonic()
    messages, metrics = run_loop(by_reply, slow_until_synced="prompt 2", max_staleness=0)
    assert time.monotonic() - start < 4, "the slow request was not waited for"
    assert sum(metrics["rollout/cancelled_stale_count"]) == 1
    versions = {s.prompt_index: s.model_version for kind, payload in messages if kind == "samples" for s in payload}
    assert sorted(versions) == list(range(6)) and versions[2] == 1, "prompt 2 came back sampled from version 1"


def wrong_count(completions, **kwargs):
    return [1.0]


def test_a_reward_returning_the_wrong_count_stops_the_run_with_its_name_at_once():
    with pytest.raises(ValueError, match="reward function 'wrong_count' returned 1 values for a group of 2"):
        run_loop(wrong_count)


class RejectEverything(ScriptedLoop):
    def filter_prompt(self, row_index, row, epoch):
        return False


def test_rejecting_a_whole_epoch_raises():
    with pytest.raises(ValueError, match="rejected every prompt of epoch 0"):
        run_loop(by_reply, loop_cls=RejectEverything)


def test_a_server_that_stops_answering_is_said_then_after_vllm_server_timeout_ends_the_worker_in_one_line(monkeypatch):
    """Nothing answers at the server's address (its process exited): requests are retried for vllm_server_timeout, and
    the user is told meanwhile; then the worker's last message is one line, not a traceback."""
    monkeypatch.setattr("tandem.rollout.server_watch.OUTAGE_SAY_S", 0.5)
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "prompt"}]}])
    settings = RolloutSettings(
        config=AsyncGRPOConfig(num_generations=2, max_completion_length=8, vllm_server_timeout=3),
        model_name="tiny",
        tokenizer_path=TINY_MODEL_PATH,
        dataset=dataset,
        reward_funcs=[by_reply],
        eos_token_ids=[TOKENIZER.eos_token_id],
        base_url=url,
        num_prompts=1,
        full_step_tokens=10_000,
    )
    channels = Channels.create(mp.get_context("spawn"))
    loop = AsyncRolloutLoop(settings, processing_class=TOKENIZER, channels=channels)
    loop._scheduler.control.max_retries = 0  # /metrics: give up at once
    with pytest.raises(ServerGone) as gone:
        asyncio.run(loop.run())
    messages = []
    while not channels.out.empty():
        messages.append(channels.out.get())
    said = [text for kind, text in messages if kind == "say"]
    assert said and said[0].startswith(f"the generation server {url} has not answered for"), messages
    assert "waiting for it up to vllm_server_timeout=3s" in said[0]
    kind, text = stop_message(gone.value, 3)
    assert kind == "server" and "did not come back within vllm_server_timeout=3s" in text and "\n" not in text


def test_a_server_without_metrics_is_said_and_the_loop_runs_at_max_concurrent_rollouts():
    with pytest.warns(
        UserWarning, match=r"/metrics did not answer .*max_concurrent_rollouts=3, not paced by its KV cache"
    ):
        messages, _ = run_loop(by_reply, max_concurrent_rollouts=3)
    assert sorted(set(prompt_indices(messages, "samples"))) == list(range(6)), "every group generated all the same"
