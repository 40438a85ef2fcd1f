"""The trainer end to end: a real spawned rollout worker and an embedded `tandem serve` with the tiny model."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop, Rollout
from tandem.generation.client import ServerProblem
from tandem.generation.launcher import EmbeddedProxy, EmbeddedServer, core_share
from tandem.kernels import exact_attention, onednn_linear
from tandem.rewards import accuracy_reward
from tandem.rollout.worker import WorkerError, WorkerLost
from tandem.runtime.sample_source import StalledError
from tandem.runtime.weight_sync import ReloadSync
from tandem.runtime.weight_transfer import TransferSync, no_one
from tandem.tasks import TINY_MODEL_PATH, arithmetic
from tests.conftest import STREAMED_REPLICA, ServerThread

pytestmark = pytest.mark.slow


def small_dataset(n=24, seed=3) -> Dataset:
    return Dataset.from_list(arithmetic.make_rows(n, split="train", seed=seed))


def config(tmp_path, **overrides) -> AsyncGRPOConfig:
    values = dict(
        output_dir=str(tmp_path / "run"),
        num_generations=4,
        max_completion_length=6,
        token_budget=256,
        learning_rate=1e-4,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
        max_steps=4,
        vllm_server_timeout=120,
        rollout_worker_timeout=60,
    )
    values.update(overrides)
    return AsyncGRPOConfig(**values)


def logged(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]


def test_at_staleness_zero_the_importance_ratio_is_one(tmp_path):
    """Bit for bit where MKL runs in its strict mode (every row of a matmul rounds alike): the tree row's attention
    and the sampler's cached decoding then sum the same numbers in the same order."""
    args = config(tmp_path, max_staleness=0, weight_sync_steps=1, max_steps=4)
    AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset()).train()
    rows = [r for r in logged(tmp_path) if "sampling/importance_sampling_ratio/mean" in r]
    assert len(rows) == 4
    allowed = 0.0 if exact_attention.ROWS_ROUND_ALIKE else 1e-4
    for r in rows:
        assert r["sample/staleness_max"] == 0
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) <= allowed, r[
            "sampling/importance_sampling_ratio/mean"
        ]
        assert r["sampling/sampling_logp_difference/max"] <= allowed, (
            "the trainer's log-probs differ from the sampler's"
        )
        if exact_attention.ROWS_ROUND_ALIKE:  # an fp32 server: nothing to correct
            assert (r["sampling/effective_sample_size"], r["sampling/mismatch_kl"]) == (1.0, 0.0)
            assert r["sampling/masked_tokens_frac"] == r["sampling/masked_sequences_frac"] == 0.0
        # Tree packing: the group's rollouts share their prompt, so fewer tokens are forwarded than sampled.
        assert r["batch/packing_ratio"] > 1.5
        assert 0.3 < r["sampling/sampler_mass"] <= 1.0 + 1e-6, "score centering (the default) logs the top-K mass"
        assert set(BATCH_METRICS) <= set(r), f"missing: {set(BATCH_METRICS) - set(r)}"
        assert "perf/weight_sync_barrier_s" not in r, "one process has no ranks to wait for"
        assert (r["batch/row_imbalance"], r["batch/pad_frac"]) == (1.0, 0.0), (
            "one row a micro-batch: balanced, unpadded"
        )
        assert r["perf/fwd_s"] < r["perf/fwd_bwd_s"], "the step's forward passes are part of its forward + backward"
    assert rows[-1]["num_tokens"] == sum(r["batch/forwarded_tokens_per_step"] for r in rows)


def test_in_flight_weight_updates_judge_a_group_by_its_tokens_and_never_past_max_staleness(tmp_path):
    """A server slowed to 50 ms a decode step, so that weight syncs land in the middle of 40-token generations: their
    later tokens carry the newer version. No group trains past the bound its tokens allow, and the samples' tokens
    carry the versions the server labelled them with (sample/mixed_tokens_frac counts those sampled after a swap)."""
    external = ServerThread(
        logprobs_mode="processed_logprobs",
        max_logprobs=20,
        weight_transfer_config='{"backend": "gloo"}',
        step_delay_s=0.05,
    )
    try:
        args = config(
            tmp_path,
            vllm_server_base_url=external.url,
            max_staleness=1,
            in_flight_weight_updates=True,
            max_completion_length=40,
            temperature=1.5,
            max_steps=6,
        )
        AsyncGRPOTrainer(TINY_MODEL_PATH, accuracy_reward, args=args, train_dataset=small_dataset(48)).train()
    finally:
        external.close()
    rows = [r for r in logged(tmp_path) if "sample/token_lag_mean" in r]
    assert len(rows) == 6
    for r in rows:
        assert r["sample/token_lag_mean"] <= 1, f"a group trained past max_staleness by its tokens: {r}"
        assert r["sample/token_lag_max"] <= r["sample/staleness_max"], "a token is never older than its group's start"
    assert any(r["sample/mixed_tokens_frac"] > 0 for r in rows), (
        "no token was sampled after a sync in its turn's middle: the test did not exercise in-flight updates"
    )


def test_the_embedded_server_recomputes_its_cache_after_each_sync_when_asked(tmp_path):
    """recompute_kv_cache_after_weight_updates reaches the embedded server, whose facts say so: no trained token is then
    counted as sampled over an older version's cache."""
    args = config(tmp_path, recompute_kv_cache_after_weight_updates=True, in_flight_weight_updates=True, max_steps=3)
    trainer = AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset())
    trainer.train()
    assert trainer.runtime.facts.recomputes_kv_cache
    assert all(r["sample/mixed_tokens_frac"] == 0 for r in logged(tmp_path) if "sample/mixed_tokens_frac" in r)


def test_gspo_with_a_sequence_correction_trains_and_logs_what_it_masked(tmp_path):
    """GSPO's sequence-level ratio with sequence_truncate, from stale samples (max_staleness 2): the run trains, its
    weights move, and the off-policy metrics are logged with every step."""
    args = config(
        tmp_path,
        max_staleness=2,
        max_steps=3,
        score_centering=False,
        importance_sampling_level="sequence",
        vllm_importance_sampling_mode="sequence_truncate",
        epsilon=3e-4,
        epsilon_high=4e-4,
    )
    trainer = AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset())
    before = next(trainer.model.parameters()).detach().clone()
    trainer.train()
    assert not torch.equal(before, next(trainer.model.parameters()).detach()), "the weights did not move"
    rows = [r for r in logged(tmp_path) if "sampling/effective_sample_size" in r]
    assert len(rows) == 3
    for r in rows:
        assert 0 < r["sampling/effective_sample_size"] <= 1.0 + 1e-12 and r["sampling/mismatch_kl"] >= 0
        assert r["sampling/masked_tokens_frac"] == 0.0, "a truncation scales tokens down, it masks none"


@pytest.mark.skipif(onednn_linear.EXACT_ROWS is None, reason="oneDNN's rows do not round alike here (or no x86 oneDNN)")
@pytest.mark.parametrize(
    "adapter",
    [False, pytest.param(True, marks=pytest.mark.long)],  # LoRA's on-policy runs: the default suite has others
    ids=["full weights", "LoRA"],
)
def test_at_staleness_zero_the_ratio_is_one_with_layers_on_onednn(tmp_path, wide_path, adapter):
    """A model wide enough that its large layers compute on oneDNN, in the trainer and in exact decoding alike; under
    LoRA the base layers do, the adapters' small products stay on MKL on both sides."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    args = config(tmp_path, max_staleness=0, max_steps=3, learning_rate=1e-3)
    trainer = AsyncGRPOTrainer(
        wide_path, varied_reward, args=args, train_dataset=small_dataset(), peft_config=lora if adapter else None
    )
    model = trainer.model.get_base_model() if adapter else trainer.model
    attention = model.model.layers[0].self_attn
    assert onednn_linear.routed(model.lm_head) and not onednn_linear.routed(attention.k_proj)
    assert onednn_linear.routed(attention.q_proj.base_layer if adapter else attention.q_proj), (
        "PEFT wraps a routed layer"
    )
    trainer.train()
    rows = [r for r in logged(tmp_path) if "sampling/importance_sampling_ratio/mean" in r]
    assert len(rows) == 3 and all(r["sample/staleness_max"] == 0 for r in rows)
    assert all(r["sampling/sampling_logp_difference/max"] == 0.0 for r in rows), "the trainer's log-probs differ"


def test_a_sync_runs_beside_the_next_step_and_ends_before_its_optimizer_changes_the_weights(tmp_path, monkeypatch):
    overlapped, real_push, real_start = [], TransferSync.push, TransferSync.push_in_thread
    monkeypatch.setattr(
        TransferSync,
        "push_in_thread",
        lambda self, model, version, announce: overlapped.append(version) or real_start(self, model, version, announce),
    )
    monkeypatch.setattr(
        TransferSync, "push", lambda *args, **kw: time.sleep(0.5) or real_push(*args, **kw)
    )  # outlasts a step

    class Checked(AsyncGRPOTrainer):
        def optimizer_step(self):
            assert self.runtime.in_flight is None, "the optimizer changed the weights a sync was still sending"
            return super().optimizer_step()

    Checked("tiny", accuracy_reward, args=config(tmp_path, max_staleness=2), train_dataset=small_dataset()).train()
    assert overlapped == [1, 2, 3], "each step's sync (no probe or evaluation due) overlapped the next; the last cannot"
    rows = [r for r in logged(tmp_path) if "perf/weight_sync_s" in r]
    assert [r["step"] for r in rows] == [2, 3, 4], "each sync is timed in the log of the step it ended in"


BATCH_METRICS = [
    "num_tokens",
    "batch/packing_ratio",
    "batch/samples_per_row",
    "batch/row_tokens_mean",
    "batch/row_tokens_max",
    "batch/row_fill_frac",
    "batch/masked_token_frac",
    "batch/forwarded_tokens_per_step",
    "batch/trained_tokens_per_step",
    "batch/samples_per_step",
    "batch/groups_per_step",
    "batch/microbatches_per_step",
    "perf/fwd_bwd_forwarded_tokens_per_s",
    "perf/wall_clock_trained_tokens_per_s",
]


class SlowTrainer(AsyncGRPOTrainer):
    def training_step(self, micro_batches):
        time.sleep(0.3)
        return super().training_step(micro_batches)


class SlowLoop(AsyncRolloutLoop):
    async def generate_one(self, prompt, tools, group_id=0):
        import asyncio

        await asyncio.sleep(0.15)
        return await super().generate_one(prompt, tools, group_id)


class SlowLoopTrainer(SlowTrainer):
    loop_cls = SlowLoop


def test_staleness_is_bounded_stale_samples_are_dropped_and_the_allowance_holds(tmp_path):
    args = config(tmp_path, max_staleness=0, max_steps=6, num_generations=4)
    SlowLoopTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset(48)).train()
    rows = logged(tmp_path)
    assert all(r["sample/staleness_max"] == 0 for r in rows if "loss" in r)
    assert sum(r["sample/dropped_stale_count"] for r in rows if "sample/dropped_stale_count" in r) > 0, (
        "groups that straddle a sync must be dropped"
    )
    used = [r["rollout/allowance_used_max"] for r in rows if "rollout/allowance_used_max" in r]
    assert used and max(used) <= 1.0 + 1e-9, f"queued + in-flight tokens exceeded the allowance: {max(used)}"


class StopAt(TrainerCallback):
    """Checkpoint and stop after `step`, as a preempted job does."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = control.should_training_stop = True
        return control


class RecordingTrainer(AsyncGRPOTrainer):
    """Keeps the rollout id of every sample it trains."""

    def training_step(self, micro_batches):
        self.trained_rollouts = getattr(self, "trained_rollouts", []) + [
            s.rollout_id for rows in micro_batches for row in rows for s in row.samples
        ]
        return super().training_step(micro_batches)


@pytest.mark.long  # one train() after another; each run's own sync probes are tested throughout this file
def test_a_second_train_call_checks_its_syncs_against_its_own_server(tmp_path):
    """Each train() starts its own embedded server; the sync probe's client went with the first one's session (it
    used to be kept, and the second run's first probe waited on a server long gone, then failed)."""
    trainer = AsyncGRPOTrainer(
        "tiny",
        accuracy_reward,
        args=config(tmp_path, max_steps=2, weight_sync_check_atol=1e-5),
        train_dataset=small_dataset(),
    )
    trainer.train()
    trainer.args.max_steps = 4
    trainer.train()
    assert trainer.state.global_step == 4
    gaps = {r["step"]: r.get("weight_sync/served_logprob_gap") for r in logged(tmp_path)}
    assert gaps == {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}, "every sync of both runs is probed and served exactly"


def test_stopped_and_resumed_at_a_random_point_a_run_finishes_every_prompt_exactly_once(tmp_path):
    seed = random.randrange(1_000_000)
    stops = [random.Random(seed).randrange(1, 5)]  # the epoch takes 5 steps or more
    data = small_dataset(48)
    # A small budget (about two groups a row) so the epoch takes more steps than the last stop.
    args = config(tmp_path, max_steps=-1, num_train_epochs=1, max_staleness=1, token_budget=100)
    finished, trained = [], []
    for index, stop in enumerate(stops + [None]):
        trainer = RecordingTrainer(
            "tiny", accuracy_reward, args=args, train_dataset=data, callbacks=[StopAt(stop)] if stop else None
        )
        trainer.train(resume_from_checkpoint=index > 0)
        assert stop is None or trainer.state.step == stop, f"stops {stops} (seed {seed}): the epoch ended before {stop}"
        finished += trainer.runtime.source.ledger.finished
        trained += getattr(trainer, "trained_rollouts", [])
    assert Counter(finished) == Counter(range(48)), (
        f"stops {stops} (seed {seed}): prompts finished twice {sorted(p for p, n in Counter(finished).items() if n > 1)}, "
        f"never {sorted(set(range(48)) - set(finished))}"
    )
    assert max(Counter(trained).values()) == 1, f"stops {stops} (seed {seed}): a saved sample was trained twice"


class KillOnce(AsyncGRPOTrainer):
    """kill -9 of one of the run's processes (`victim`: "server" or "worker") at the start of step `after` + 1: mid-run,
    with requests in flight."""

    victim, after = "server", 2

    def training_step(self, micro_batches):
        if self.state.step == self.after and not hasattr(self, "killed"):
            self.killed = getattr(self.runtime.session, self.victim).process.pid
            os.kill(self.killed, signal.SIGKILL)
        return super().training_step(micro_batches)


class KillWorkerAfterStepOne(KillOnce):
    victim, after = "worker", 1


def test_a_killed_worker_is_restarted_once_where_it_left_off_and_the_epoch_is_trained_whole(tmp_path, capsys):
    args = config(tmp_path, max_steps=-1, num_train_epochs=1, token_budget=100)  # ~2 groups a row: several steps
    trainer = KillWorkerAfterStepOne("tiny", accuracy_reward, args=args, train_dataset=small_dataset(24))
    trainer.train()
    assert trainer.runtime.session.worker.process.pid != trainer.killed
    assert sum(r.get("rollout/worker_restart_count", 0) for r in logged(tmp_path)) == 1
    assert Counter(trainer.runtime.source.ledger.finished) == Counter(range(24)), (
        "every prompt finished once across the restart"
    )
    assert "exited with code -9 without reporting an error. Restarted it from prompt index" in capsys.readouterr().err


class KillWorkerTwice(AsyncGRPOTrainer):
    """kill -9 of the rollout worker at steps 2 and 4: the second loss is one too many."""

    def training_step(self, micro_batches):
        if self.state.step in (1, 3) and self.runtime.session.worker.process.pid not in self.killed:
            self.killed.append(self.runtime.session.worker.process.pid)
            os.kill(self.killed[-1], signal.SIGKILL)
        return super().training_step(micro_batches)


@pytest.mark.long  # the first loss, restarted where it left off, is tested in the default suite
def test_a_worker_lost_a_second_time_stops_the_run(tmp_path):
    trainer = KillWorkerTwice(
        "tiny", accuracy_reward, args=config(tmp_path, max_steps=8), train_dataset=small_dataset(64)
    )
    trainer.killed = []
    with pytest.raises(WorkerLost, match="code -9"):
        trainer.train()
    assert len(trainer.killed) == 2 and sum(r.get("rollout/worker_restart_count", 0) for r in logged(tmp_path)) == 1


def never_varies(completions, **kwargs):
    """A reward the model never moves: every group has zero variance and trains nothing."""
    return [0.0] * len(completions)


def test_a_reward_that_never_varies_is_said_and_stops_the_run_instead_of_a_silent_wait(tmp_path, capsys):
    args = config(tmp_path, stall_timeout=8, max_steps=2)  # counted from the worker's first message
    trainer = AsyncGRPOTrainer("tiny", never_varies, args=args, train_dataset=small_dataset(200))
    with pytest.raises(
        StalledError,
        match=r"no trainable sample for \ds of waiting: \d+ groups dropped without reward variance, "
        r"filtered out or failed \(rewards seen: 0 x\d+; 0 failed\).*stall_timeout=8s",
    ):
        trainer.train()
    said = capsys.readouterr().err
    assert "tandem: no trainable sample for" in said, "50 dropped groups are said before the stop"
    stalled = [row for row in logged(tmp_path) if "stalled_s" in row]
    assert stalled and stalled[0]["frac_reward_zero_std"] == 1.0, "the worker's metrics are logged while nothing trains"


def test_sigterm_with_enable_jit_checkpoint_saves_the_step_it_ends_and_exits_as_terminated(tmp_path):
    run = tmp_path / "run"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem",
            "train",
            "examples/demo.yaml",
            "--max_steps",
            "300",
            "--save_steps",
            "1000",
            "--enable_jit_checkpoint",
            "true",
            "--output_dir",
            str(run),
            "--save_only_model",
            "true",
        ],  # the preemption's checkpoint still holds what resuming needs
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while not ((run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, "the run did not reach step 3"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)  # as torchrun and SLURM do: the server and the worker get it too
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert [p.name for p in run.glob("checkpoint-*")] == [f"checkpoint-{last}"], "the step it stopped at is saved"
    assert (run / f"checkpoint-{last}" / "rollout_state.json").is_file(), "resumable, whatever save_only_model says"
    assert f"stopped on SIGTERM after a checkpoint at step {last}" in err


def test_errors_before_any_training_work(tmp_path):
    with pytest.raises(ValueError, match="no 'prompt' column"):
        AsyncGRPOTrainer(
            "tiny", accuracy_reward, args=config(tmp_path), train_dataset=Dataset.from_list([{"question": "hi"}])
        )
    with pytest.raises(ValueError, match="must be conversational"):
        AsyncGRPOTrainer(
            "tiny",
            accuracy_reward,
            args=config(tmp_path),
            train_dataset=Dataset.from_list([{"prompt": "What is 1 + 1?"}]),
        )
    trainer = AsyncGRPOTrainer(
        "tiny", lambda completions, **kw: [1.0] * len(completions), args=config(tmp_path), train_dataset=small_dataset()
    )
    with pytest.raises(TypeError, match="not picklable.*module-level function"):
        trainer.train()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_unreachable_server_is_named(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = config(tmp_path, vllm_server_base_url=f"http://127.0.0.1:{port}", vllm_server_timeout=1.5)
    with pytest.raises(ServerProblem, match=f"127.0.0.1:{port}/health did not answer"):
        AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset()).train()


def test_a_server_that_stops_serving_the_synced_weights_stops_the_run_with_the_numbers(tmp_path, monkeypatch):
    """A failed probe is not a lost server: no waiting for it, no syncing again (which, for LoRA, reloaded a name vLLM
    already held and died in a traceback). Here the third probe sees other weights."""
    from tandem.runtime import sync_check

    served_logprobs, probes = sync_check.SyncProbe.served_logprobs, []

    async def drifting(probe, client, served_name):
        probes.append(served_name)
        completion, served = await served_logprobs(probe, client, served_name)
        return completion, [value + (0.0167 if len(probes) == 3 else 0.0) for value in served]

    monkeypatch.setattr(sync_check.SyncProbe, "served_logprobs", drifting)
    external = ServerThread(logprobs_mode="processed_logprobs", max_logprobs=20)
    try:
        args = config(
            tmp_path, vllm_server_base_url=external.url, max_staleness=0, max_steps=6, weight_sync_check_atol=1e-4
        )
        trainer = AsyncGRPOTrainer(TINY_MODEL_PATH, accuracy_reward, args=args, train_dataset=small_dataset())
        with pytest.raises(
            ServerProblem,
            match=r"differ from the trainer's by up to 0.0167 over \d+ tokens \(allowed: 0.0001, weight_sync_check_atol\)",
        ):
            trainer.train()
    finally:
        external.close()
    assert len(probes) == 3 and trainer.state.global_step == 2, "stopped at the sync that failed, not synced again"


@pytest.mark.parametrize("sync_reaches_the_server", [True, False])
def test_against_a_bf16_server_the_probe_passes_rounding_and_stops_a_sync_that_never_arrived(
    tmp_path, monkeypatch, sync_reaches_the_server
):
    """A bf16 server rounds the probe's log-probs 0.06 RMS from an fp32 trainer's (0.3 at a token), beyond any fixed
    bound a missed sync could be told by; the probe asks instead which version the server's log-probs sit nearer."""
    if not sync_reaches_the_server:
        push = ReloadSync.push

        def connect_only(sync, model, version, announce=no_one):
            if version == 0:
                return push(sync, model, version, announce)
            announce(version, time.monotonic())  # the rollouts are told of the new version, the server never loads it
            return {}

        monkeypatch.setattr(ReloadSync, "push", connect_only)
    external = ServerThread(dtype="bfloat16", logprobs_mode="processed_logprobs", max_logprobs=20)
    try:
        args = config(tmp_path, vllm_server_base_url=external.url, max_staleness=0, max_steps=4, learning_rate=2e-4)
        trainer = AsyncGRPOTrainer(TINY_MODEL_PATH, accuracy_reward, args=args, train_dataset=small_dataset())
        if sync_reaches_the_server:
            trainer.train()
        else:
            with pytest.raises(ServerProblem, match="nearer the weights it served at the first probe .* did not reach"):
                trainer.train()
    finally:
        external.close()
    if sync_reaches_the_server:
        probed = [r["step"] for r in logged(tmp_path) if "weight_sync/served_logprob_gap" in r]
        assert probed and len(probed) < 4, f"the probes end once a sync is seen to move the server: {probed}"


def test_a_prompt_too_long_for_the_server_is_named(tmp_path):
    rows = arithmetic.make_rows(4, seed=0) + [{"prompt": [{"role": "user", "content": "1 " * 1200}], "solution": "1"}]
    with pytest.raises(ValueError, match="row 4: the prompt renders to .* max_model_len is 1024"):
        AsyncGRPOTrainer("tiny", accuracy_reward, args=config(tmp_path), train_dataset=Dataset.from_list(rows)).train()


class CrashingLoop(AsyncRolloutLoop):
    async def generate_one(self, prompt, tools, group_id=0):
        raise RuntimeError("boom from the rollout loop")


class CrashingTrainer(AsyncGRPOTrainer):
    loop_cls = CrashingLoop


class HangingLoop(AsyncRolloutLoop):
    async def generate_one(self, prompt, tools, group_id=0):
        time.sleep(30)  # blocks the event loop: no heartbeat


class HangingTrainer(AsyncGRPOTrainer):
    loop_cls = HangingLoop


@pytest.mark.report
def test_a_crashed_worker_stops_training_with_its_traceback_and_no_restart(tmp_path):
    with pytest.raises(
        WorkerError, match="(?s)boom from the rollout loop.*Traceback|Traceback.*boom from the rollout loop"
    ):
        CrashingTrainer("tiny", accuracy_reward, args=config(tmp_path), train_dataset=small_dataset()).train()
    assert "reward" in (tmp_path / "run" / "report.html").read_text(), "a crashed run still writes its report"


def test_a_hung_worker_is_detected_by_its_heartbeat(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerError, match="no heartbeat"):
        HangingTrainer(
            "tiny", accuracy_reward, args=config(tmp_path, rollout_worker_timeout=3), train_dataset=small_dataset()
        ).train()
    assert time.monotonic() - start < 25


def server_omp_threads(trainer) -> str | None:
    """OMP_NUM_THREADS in the environment of the trainer's embedded server process."""
    environ = open(f"/proc/{trainer.runtime.session.server.process.pid}/environ", "rb").read().split(b"\0")
    return next((v.decode().split("=", 1)[1] for v in environ if v.startswith(b"OMP_NUM_THREADS=")), None)


class RecordThreads(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.append((torch.get_num_threads(), server_omp_threads(self.trainer)))


def threads_in_one_step(tmp_path) -> list[tuple[int, str | None]]:
    """(the trainer's threads, the server's OMP_NUM_THREADS) at the one step of a one-step run."""
    record = RecordThreads()
    trainer = AsyncGRPOTrainer(
        "tiny", accuracy_reward, args=config(tmp_path, max_steps=1), train_dataset=small_dataset(), callbacks=[record]
    )
    record.trainer = trainer
    trainer.train()
    return record.seen


def test_a_cpu_trainer_and_its_embedded_server_split_the_cores_and_the_threads_come_back_after(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    share = core_share()
    assert threads_in_one_step(tmp_path) == [(share, str(share))], (
        "the trainer and the server compute with half the cores each"
    )
    assert torch.get_num_threads() == before, "the process's own thread count is back once train() returns"


def test_omp_num_threads_set_by_the_user_decides_the_threads_of_both(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # read by the server as it starts; this process's torch keeps its count
    before = torch.get_num_threads()
    assert threads_in_one_step(tmp_path) == [(before, "3")], (
        "with OMP_NUM_THREADS set, tandem leaves both thread counts alone"
    )


def test_a_killed_embedded_server_is_restarted_with_the_current_weights_and_the_run_goes_on(tmp_path, capsys):
    # max_staleness 0: every sample trained after the restart was generated by it, under the current version
    args = config(tmp_path, max_staleness=0, max_steps=6, learning_rate=1e-3)
    record = RecordThreads()
    trainer = KillOnce("tiny", accuracy_reward, args=args, train_dataset=small_dataset(48), callbacks=[record])
    record.trainer = trainer
    trainer.train()
    rows = logged(tmp_path)
    assert trainer.state.step == 6 and trainer.runtime.session.server.process.pid != trainer.killed
    assert record.seen[-1][1] == str(core_share()), "the restarted server keeps its share of the cores"
    assert sum(r.get("rollout/server_restart_count", 0) for r in rows) == 1
    ratios = [r["sampling/importance_sampling_ratio/mean"] for r in rows if r["step"] >= 3 and "stalled_s" not in r]
    assert all(abs(ratio - 1.0) < 1e-4 for ratio in ratios), (
        f"the restarted server samples from the trained weights: {ratios}"
    )
    assert (
        "the embedded tandem serve exited (code -9); restarting it with the weights of step" in capsys.readouterr().err
    )


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_an_embedded_server_that_keeps_dying_stops_the_run_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr("tandem.runtime.embedded_server.SERVER_RESTARTS", 0)
    with pytest.raises(RuntimeError, match=r"the embedded tandem serve exited \(code -9\)"):
        KillOnce("tiny", accuracy_reward, args=config(tmp_path, max_steps=20), train_dataset=small_dataset()).train()


def external_server(port: int, log_path) -> EmbeddedServer:
    """`tandem serve` as a user starts it beside the trainer, receiving weights over gloo."""
    return EmbeddedServer(
        TINY_MODEL_PATH,
        log_path=log_path,
        extra_args=[
            "--port",
            str(port),
            "--served-model-name",
            TINY_MODEL_PATH,
            "--logprobs-mode",
            "processed_logprobs",
            "--weight-transfer-config",
            '{"backend": "gloo"}',
            "--weight-transfer-timeout-s",
            "20",
        ],
    )


class BounceExternalServer(AsyncGRPOTrainer):
    """After step 1 the external server is killed, and started again on its port 1 s later."""

    def training_step(self, micro_batches):
        if self.state.step == 1 and not hasattr(self, "back"):
            os.kill(self.server.process.pid, signal.SIGKILL)
            self.back = []
            port = int(self.args.vllm_server_base_url.rsplit(":", 1)[1])
            threading.Timer(1, lambda: self.back.append(external_server(port, self.server.log_path))).start()
        return super().training_step(micro_batches)


def test_an_external_server_that_goes_away_and_comes_back_within_vllm_server_timeout_loses_no_group(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = external_server(port, tmp_path / "server.log")
    args = config(
        tmp_path,
        vllm_server_base_url=f"http://127.0.0.1:{port}",
        max_steps=-1,
        num_train_epochs=1,
        token_budget=100,
        max_staleness=1,
    )  # the worker cannot finish the epoch before the outage
    trainer = BounceExternalServer("tiny", accuracy_reward, args=args, train_dataset=small_dataset(24))
    trainer.server = first
    try:
        trainer.train()
    finally:
        first.stop()
        for server in getattr(trainer, "back", []):
            server.stop()
    rows = logged(tmp_path)
    assert len(trainer.back) == 1, "the server was started again"
    assert sum(r.get("rollout/vllm_retry_count", 0) for r in rows) > 0, "requests waited for it with backoff"
    assert sum(r.get("rollout/server_reconnect_count", 0) for r in rows) == 1, (
        "the next sync joined its new transfer group"
    )
    assert Counter(trainer.runtime.source.ledger.finished) == Counter(range(24)), "no group lost"


class KillExternalServerAfterStepOne(AsyncGRPOTrainer):
    """After step 1 the external server is killed for good."""

    def training_step(self, micro_batches):
        if self.state.step == 1 and not hasattr(self, "killed"):
            self.killed = os.kill(self.server.process.pid, signal.SIGKILL) or True
        return super().training_step(micro_batches)


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_an_external_server_gone_for_good_is_waited_for_saying_so_then_ends_the_run_in_one_line(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = external_server(port, tmp_path / "server.log")
    args = config(tmp_path, vllm_server_base_url=f"http://127.0.0.1:{port}", max_steps=20, vllm_server_timeout=12)
    trainer = KillExternalServerAfterStepOne("tiny", accuracy_reward, args=args, train_dataset=small_dataset(24))
    trainer.server = server
    try:
        with pytest.raises(ServerProblem, match="did not come back") as stopped:
            trainer.train()
    finally:
        server.stop()
    assert "vllm_server_timeout=12s" in str(stopped.value) and "Traceback" not in str(stopped.value)
    said = capsys.readouterr().err
    assert "waiting up to vllm_server_timeout=12s" in said, "the wait is said as it begins, not only when it ends"


class KillReplicaAfterStepTwo(TrainerCallback):
    """kill -9 of replica 1 behind the proxy after step 2; it is started again on its port 3 s later. The run stops two
    steps after the proxy routes to both replicas again."""

    def __init__(self, replicas: list[EmbeddedServer], flags: list[str], proxy_url: str):
        self.replicas, self.flags, self.proxy_url, self.back, self.timer = replicas, flags, proxy_url, [], None
        self.both_up_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.timer is not None and self.both_up_at is None:
            with urllib.request.urlopen(self.proxy_url + "/proxy/stats") as response:
                if [u["state"] for u in json.load(response)["upstreams"]] == ["up", "up"]:
                    self.both_up_at = state.global_step
        if self.both_up_at is not None and state.global_step >= self.both_up_at + 2:
            control.should_training_stop = True
        if state.global_step == 2 and self.timer is None:
            victim = self.replicas[1]
            os.kill(victim.process.pid, signal.SIGKILL)
            port = victim.url.rsplit(":", 1)[1]
            self.timer = threading.Timer(
                3,
                lambda: self.back.append(
                    EmbeddedServer(TINY_MODEL_PATH, log_path=victim.log_path, extra_args=[*self.flags, "--port", port])
                ),
            )
            self.timer.start()


@pytest.mark.long
def test_a_replica_killed_behind_the_proxy_is_left_out_then_brought_to_the_current_weights(tmp_path):
    """Trainer -> tandem proxy -> two tandem serve replicas receiving weights over gloo. Replica 1 dies after step 2:
    the next sync is refused (409) and the trainer forms the transfer group with replica 0 alone; replica 1 comes back
    behind, the next sync forms the group with both, and it serves again. Every sync is checked and staleness is 0."""
    flags = STREAMED_REPLICA
    replicas = [
        EmbeddedServer(TINY_MODEL_PATH, log_path=tmp_path / f"replica{i}.log", extra_args=flags) for i in range(2)
    ]
    proxy = EmbeddedProxy(
        [r.url for r in replicas], log_path=tmp_path / "proxy.log", extra_args=["--tokenizer", TINY_MODEL_PATH]
    )
    kill = KillReplicaAfterStepTwo(replicas, flags, proxy.url)
    args = config(
        tmp_path,
        vllm_server_base_url=proxy.url,
        max_steps=100,
        max_staleness=0,
        token_budget=100,
        weight_sync_check_atol=1e-5,
    )
    try:
        AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset(96), callbacks=[kill]).train()
        with urllib.request.urlopen(proxy.url + "/proxy/stats") as response:
            stats = json.load(response)
    finally:
        if kill.timer is not None:
            kill.timer.join()
        for process in [proxy, *replicas, *kill.back]:
            process.stop()
    rows = [r for r in logged(tmp_path) if "loss" in r]
    assert kill.both_up_at is not None and len(rows) < 100, "replica 1 served again before the run's end"
    assert sum(r.get("rollout/server_reconnect_count", 0) for r in rows) == 2, (
        "the group formed without it, then with it"
    )
    assert [u["state"] for u in stats["upstreams"]] == ["up", "up"], stats
    assert all(abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4 for r in rows), (
        "exactly on-policy throughout"
    )
    assert all(r["weight_sync/served_logprob_gap"] <= 1e-5 for r in rows if "weight_sync/served_logprob_gap" in r)


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumRolloutLoop(AsyncRolloutLoop):
    """TRL's curriculum example, as its documentation writes it."""

    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


class CurriculumTrainer(AsyncGRPOTrainer):
    loop_cls = CurriculumRolloutLoop


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_a_curriculum_loop_runs(tmp_path):
    values = {k: v for k, v in vars(config(tmp_path, max_steps=3)).items()}
    trainer = CurriculumTrainer(
        "tiny", accuracy_reward, args=CurriculumConfig(**values, pass_rate_cap=0.5), train_dataset=small_dataset()
    )
    assert trainer.train().global_step == 3


def test_samples_longer_than_the_token_budget_are_dropped_with_a_warning(tmp_path):
    # Prompts render to 17-18 tokens: samples with completions of more than two or three tokens exceed 20.
    args = config(tmp_path, max_steps=-1, num_train_epochs=1, token_budget=20)
    trainer = AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset(8))
    with pytest.warns(UserWarning, match="exceeds token_budget=20"):
        trainer.train()
    assert sum(r["batch/dropped_oversize_count"] for r in logged(tmp_path) if "batch/dropped_oversize_count" in r) > 0
    assert set(trainer.runtime.source.ledger.finished) == set(range(8)), "dropped samples still finish their prompt"


def test_flash_reinforce_trains_exactly_b_single_rollouts_a_step_with_the_batch_baseline(tmp_path):
    args = config(
        tmp_path,
        algorithm="flash_reinforce",
        num_generations=1,
        max_staleness=0,
        max_steps=3,
        flash_delta=3e-3,
        flash_batch_size=7,
        token_budget=64,
    )
    trainer = AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset(48))
    trainer.train()
    rows = logged(tmp_path)
    for r in rows:
        assert r["batch/samples_per_step"] == 7, "flash_batch_size: exactly B trajectories a step (FlashREINFORCE's B)"
        assert r["batch/microbatches_per_step"] > 1, "as many micro-batches as the token budget needs"
        # On policy (staleness 0) the policy equals the sampler: every trajectory's KL is 0 and passes the gate.
        assert r["flash/acceptance_rate"] == 1.0 and r["flash/sequence_kl_max"] < 1e-6
        assert r["flash/retained_tokens_frac"] == 1.0
        assert r["batch/samples_per_step"] == r["batch/groups_per_step"], "one rollout (and one sample) per prompt"
        assert r["frac_reward_zero_std"] == 0.0, "a single rollout has no group variance, and FlashREINFORCE keeps it"


def test_top_k_top_p_ratios_are_exact_with_sampling_masks_and_biased_without(tmp_path):
    truncated = {"top_k": 10, "top_p": 0.7, "max_staleness": 0, "max_steps": 2, "temperature": 1.0}
    AsyncGRPOTrainer("tiny", accuracy_reward, args=config(tmp_path, **truncated), train_dataset=small_dataset()).train()
    for r in logged(tmp_path):
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4, r[
            "sampling/importance_sampling_ratio/mean"
        ]

    # A server without --return-sampling-mask: the worker warns and the ratio is the kept mass, visibly below 1.
    plain = ServerThread(logprobs_mode="processed_logprobs", served_model_name=[TINY_MODEL_PATH])
    try:
        args = config(tmp_path / "off", vllm_server_base_url=plain.url, **truncated)
        AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset()).train()
    finally:
        plain.close()
    means = [r["sampling/importance_sampling_ratio/mean"] for r in logged(tmp_path / "off")]
    assert max(means) < 0.97, f"without renormalisation the ratio should show the truncated mass: {means}"


def test_lora_training_syncs_versioned_adapters_and_samples_from_them(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    # weight_sync_check_atol: after every sync the served log-probs under the new name must match the trainer's.
    args = config(
        tmp_path,
        max_staleness=0,
        max_steps=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=4,
        weight_sync_check_atol=1e-5,
    )
    trainer = AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset(), peft_config=lora)
    trainer.train()
    for r in logged(tmp_path):  # at staleness 0 every rollout sampled from exactly the adapter being trained
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4, r[
            "sampling/importance_sampling_ratio/mean"
        ]
        assert r["weight_sync/served_logprob_gap"] <= 1e-5
    kept = sorted(p.name for p in (tmp_path / "run" / ".vllm_lora").iterdir())
    assert kept == ["tandem-policy-v3", "tandem-policy-v4"], (
        "max_staleness + 1 versions stay loaded; a folder goes one sync after its unload; older ones are deleted"
    )
    assert (tmp_path / "run" / "checkpoint-4" / "adapter_model.safetensors").exists(), "checkpoints keep the adapter"

    # Resuming loads the adapter and serves it under the run's current version: still exactly on policy.
    args = config(
        tmp_path,
        max_staleness=0,
        max_steps=6,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=4,
        resume_from_checkpoint=True,
    )  # the config's field, as a recipe sets it
    resumed = AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset(), peft_config=lora)
    out = resumed.train()
    assert out.global_step == 6 and abs(out.metrics["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4


@pytest.mark.long  # the model-family matrix trains an adapter on every family, on policy
def test_an_all_linear_adapter_trains_on_policy(tmp_path):
    """target_modules="all-linear", as TRL's and PEFT's examples write it: every linear layer but the head, served as
    trained (each sync's probe within 1e-5)."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    args = config(tmp_path, max_staleness=0, max_steps=2, learning_rate=1e-3, weight_sync_check_atol=1e-5)
    trainer = AsyncGRPOTrainer("tiny", accuracy_reward, args=args, train_dataset=small_dataset(), peft_config=lora)
    adapted = {name.rsplit(".", 1)[-1] for name, module in trainer.model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trainer.train()
    for r in logged(tmp_path):
        assert (
            abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4
            and r["weight_sync/served_logprob_gap"] <= 1e-5
        )


def test_lora_against_a_server_without_adapters_syncs_merged_weights_with_a_warning(tmp_path):
    from peft import LoraConfig

    plain = ServerThread(
        logprobs_mode="processed_logprobs", max_logprobs=20
    )  # no --enable-lora; its own: reloads mutate it
    try:
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        args = config(
            tmp_path,
            max_staleness=0,
            max_steps=3,
            learning_rate=1e-3,
            vllm_server_base_url=plain.url,
            weight_sync_check_atol=1e-3,
        )
        trainer = AsyncGRPOTrainer(
            TINY_MODEL_PATH, accuracy_reward, args=args, train_dataset=small_dataset(), peft_config=lora
        )
        with pytest.warns(UserWarning, match="syncing the merged model .* started without LoRA support"):
            trainer.train()
    finally:
        plain.close()
    rows = logged(tmp_path)
    assert len(rows) == 3 and not (tmp_path / "run" / ".vllm_lora").exists()
    for r in rows:  # x·(W + s·B·A) served, x·W + s·(x·A)·B trained: equal up to rounding (~1e-4 on a log-prob)
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4
        assert r["weight_sync/served_logprob_gap"] <= 1e-3


def test_an_adapter_on_lm_head_is_refused(tmp_path):
    from peft import LoraConfig

    with pytest.raises(ValueError, match="targets lm_head"):
        AsyncGRPOTrainer(
            "tiny",
            accuracy_reward,
            args=config(tmp_path),
            train_dataset=small_dataset(),
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
        )


def test_an_adapter_on_an_moes_fused_expert_weights_is_refused_naming_what_to_target(tmp_path):
    from peft import LoraConfig

    from tests.families.catalog import BY_NAME

    with pytest.raises(
        NotImplementedError,
        match=r"LoRA on an MoE's parameter-wrapped weights, its experts or router "
        r"\(mlp.experts, mlp.gate\).*"
        r"target_modules=\['q_proj', 'k_proj', 'v_proj', 'o_proj'\]",
    ):
        AsyncGRPOTrainer(
            BY_NAME["Qwen3-MoE"].build(),
            accuracy_reward,
            args=config(tmp_path),
            train_dataset=small_dataset(),
            peft_config=LoraConfig(r=4, target_modules="all-linear"),
        )


def test_a_model_that_drops_units_in_training_is_warned_of_with_the_settings_that_turn_it_off():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from tandem.trainer.model import warn_dropout

    with pytest.warns(
        UserWarning,
        match=r"drops units in training \(attn_pdrop=0.1, embd_pdrop=0.1, resid_pdrop=0.1\)"
        r".*model_init_kwargs: \{attn_pdrop: 0.0, embd_pdrop: 0.0, resid_pdrop: 0.0\}",
    ):
        warn_dropout(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))  # GPT-2's defaults
    with pytest.warns(UserWarning, match=r"attention_dropout=0.05"):  # a functional dropout: no nn.Dropout module
        warn_dropout(
            LlamaForCausalLM(
                LlamaConfig(
                    num_hidden_layers=1,
                    hidden_size=32,
                    intermediate_size=64,
                    num_attention_heads=2,
                    vocab_size=64,
                    attention_dropout=0.05,
                )
            )
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_dropout(
            GPT2LMHeadModel(
                GPT2Config(
                    n_layer=1, n_embd=32, n_head=2, vocab_size=64, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0
                )
            )
        )  # its summary head's rate is unused


def test_a_reward_model_is_refused_at_construction_not_in_the_worker(tmp_path):
    from transformers import AutoModelForCausalLM

    for reward in (AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH), "org/reward-model"):
        with pytest.raises(
            ValueError, match="reward models are not supported .as in TRL's AsyncGRPOTrainer.; pass a function"
        ):
            AsyncGRPOTrainer("tiny", [accuracy_reward, reward], args=config(tmp_path), train_dataset=small_dataset())


def test_two_reward_functions_of_one_name_are_refused_at_construction(tmp_path):
    import functools

    double, triple = functools.partial(accuracy_reward), functools.partial(accuracy_reward)  # both named 'partial'
    with pytest.raises(ValueError, match="reward functions share the name 'partial': give each its own"):
        AsyncGRPOTrainer("tiny", [double, triple], args=config(tmp_path), train_dataset=small_dataset())


def test_train_takes_transformers_trial_and_ignore_keys_for_eval_as_trl_spells_them(tmp_path):
    trainer = AsyncGRPOTrainer(
        "tiny", accuracy_reward, args=config(tmp_path, max_steps=1), train_dataset=small_dataset()
    )
    with pytest.warns(UserWarning, match="ignore_keys_for_eval=.... has no effect"):
        assert trainer.train(trial=None, ignore_keys_for_eval=["logits"]).global_step == 1


@pytest.mark.long
def test_the_two_replica_lora_example_trains_through_the_proxy_exactly_on_policy(tmp_path):
    """examples/lora_two_replicas.py, shortened: at staleness 0 every rollout, whichever replica served it, sampled
    from exactly the adapter being trained, and every sync reached both replicas."""
    out = tmp_path / "run"
    subprocess.run(
        [
            sys.executable,
            "examples/lora_two_replicas.py",
            "--steps",
            "5",
            "--max-staleness",
            "0",
            "--output-dir",
            str(out),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    rows = logged(tmp_path)
    assert len(rows) == 5
    for r in rows:
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-4, r[
            "sampling/importance_sampling_ratio/mean"
        ]
        assert r["weight_sync/served_logprob_gap"] <= 1e-5
    stats = json.loads((out / "proxy_stats.json").read_text())
    assert all(u["routed"] > 0 for u in stats["upstreams"]), f"both replicas generate: {stats}"
    assert stats["router"]["affinity"] > 0, f"groups of one prompt stick to a replica: {stats}"


@pytest.mark.long
def test_a_script_without_a_main_guard_is_told_how_to_fix_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from datasets import Dataset\n"
        "from tandem import AsyncGRPOConfig, AsyncGRPOTrainer\n"
        "from tandem.rewards import accuracy_reward\n"
        "from tandem.tasks import arithmetic\n"
        f"args = AsyncGRPOConfig(output_dir={str(tmp_path / 'run')!r}, max_steps=1, num_generations=2, save_strategy='no')\n"
        "AsyncGRPOTrainer('tiny', accuracy_reward, args=args,\n"
        "                 train_dataset=Dataset.from_list(arithmetic.make_rows(4, split='train', seed=0))).train()\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and 'if __name__ == "__main__":' in run.stderr.splitlines()[-1], run.stderr[-2000:]


def varied_reward(completions, **kwargs) -> list[float]:
    """Rewards that always differ within a group, so that every group trains."""
    return [float(i) for i in range(len(completions))]


class ForkingLoop(AsyncRolloutLoop):
    """Three turns per rollout; the history is re-rendered without the previous reply's text (as templates that
    strip earlier reasoning do), so each later turn forks: up to 3 samples per rollout."""

    async def generate_one(self, prompt, tools, group_id=0):
        messages, turns = list(prompt), []
        for _ in range(3):
            turn = await self.generate_one_turn(self.render(messages))
            turns.append(turn)
            messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": "Again?"}]
        reply = self.tokenizer.decode(turns[0].output_ids, skip_special_tokens=True)
        return Rollout(
            completion=[{"role": "assistant", "content": reply}],
            completion_ids=[t for turn in turns for t in turn.output_ids],
            turns=turns,
        )


class ForkingTrainer(AsyncGRPOTrainer):
    loop_cls = ForkingLoop


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_forking_rollouts_train_every_prompt_of_both_epochs_without_stale_drops(tmp_path):
    """The pacing reserves what rollouts really produce (a forking group puts ~3x the tokens of a single-turn one
    on the queue), at max_staleness 1 the room a step frees goes back once its rows are placed (the groups it admits,
    under the served policy, can still train at the next step) and a step ends on a whole group, so nothing goes
    stale at max_staleness 1; num_train_epochs counts prompts, not the samples forks make, so the forking run takes
    more steps over the same two epochs."""
    data, runs = small_dataset(8), {}
    for name, trainer_cls in (("fork", ForkingTrainer), ("single", AsyncGRPOTrainer)):
        args = config(
            tmp_path / name,
            max_steps=-1,
            num_train_epochs=2,
            num_generations=3,
            max_staleness=1,
            token_budget=160,
            max_completion_length=4,
        )
        trainer = trainer_cls("tiny", varied_reward, args=args, train_dataset=data)
        runs[name] = (trainer, trainer.train().global_step, logged(tmp_path / name))
    for name, (trainer, _steps, rows) in runs.items():
        assert sorted(trainer.runtime.source.ledger.finished) == list(range(16)), (
            f"{name}: every prompt group of both epochs"
        )
        assert not any(r.get("sample/dropped_stale_count") for r in rows), f"{name}: no group generated too far ahead"
        assert rows[-1]["epoch"] == 2.0
    forks = [r["rollout/samples_per_rollout"] for r in runs["fork"][2] if "rollout/samples_per_rollout" in r]
    assert sum(forks) / len(forks) > 2.5, "the workload forks (an empty reply re-renders unchanged)"
    assert runs["fork"][1] > runs["single"][1], "forks make more samples, so more optimizer steps for the same epochs"


class ForkingFlashTrainer(ForkingTrainer):
    """Records which rollouts each optimizer step trained."""

    def training_step(self, micro_batches):
        self.steps_rollouts = getattr(self, "steps_rollouts", []) + [
            {s.rollout_id for mb in micro_batches for row in mb for s in row.samples}
        ]
        return super().training_step(micro_batches)


@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_flash_reinforce_trains_all_samples_of_a_multi_turn_rollout_in_one_step(tmp_path):
    args = config(
        tmp_path,
        algorithm="flash_reinforce",
        num_generations=1,
        max_staleness=1,
        max_steps=8,
        token_budget=90,
        max_completion_length=4,
    )
    trainer = ForkingFlashTrainer("tiny", arithmetic.correctness_reward, args=args, train_dataset=small_dataset(48))
    trainer.train()
    seen = [rollout for step in trainer.steps_rollouts for rollout in step]
    assert len(seen) == len(set(seen)), "a rollout's samples (one trajectory) are never split across optimizer steps"
    assert any(r.get("rollout/samples_per_rollout", 0) > 1 for r in logged(tmp_path)), "the rollouts fork"
