"""Real runs write the documented metrics to metrics.jsonl. Three short runs against the embedded `tandem serve`
between them meet the condition of every documented metric that one CPU process can: a GRPO run of the tiny model on
arithmetic (with a stand-in GPU peak, so that it logs MFU), an agent run (tools, an environment, several turns) and
a run of a small random MoE with a token budget some samples exceed. A documented metric no run here can write is
named in NOT_PRODUCED_HERE with the test that checks it instead."""

import re
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import TrainerCallback

from tandem import AsyncGRPOTrainer
from tandem.metrics.catalogue import find
from tandem.rewards import accuracy_reward
from tests.conftest import chat_prompt, saved_with_tiny_tokenizer
from tests.families.catalog import BY_NAME
from tests.trainer.test_agent_training import AlwaysCallsTrainer, IncrementEnv, args, multiply, random_reward
from tests.trainer.test_trainer import SlowLoopTrainer, config, logged, small_dataset, varied_reward

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

DOCUMENTED_METRICS = (
    # ---- training: rewards, completions, the loss's terms -----------------------------------------------------------
    "num_tokens",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
    "completions/clipped_ratio",
    "completions/duplicate_frac",
    "tools/call_frequency",
    "tools/failure_frequency",
    "rewards/{source}/mean",
    "rewards/{source}/group_std",
    "reward",
    "reward_group_std",
    "reward_kept",
    "reward_dropped",
    "frac_reward_zero_std",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/masked_mean",
    "sampling/sampler_mass",
    "entropy",
    "aux_loss",
    "clip_ratio/region_mean",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    # ---- rollouts ---------------------------------------------------------------------------------------------------
    "rollout/duration_s",
    "rollout/generated_tokens_per_s",
    "rollout/concurrency",
    "rollout/concurrency_cap",
    "rollout/turns_mean",
    "rollout/turns_max",
    "rollout/samples_per_rollout",
    "rollout/fork_frac",
    "rollout/drift_tokens_mean",
    "rollout/drift_tokens_max",
    "rollout/score_queue_size",
    "rollout/queue_size",
    "rollout/score_s",
    "rollout/score_wait_s",
    "rollout/score_block_s",
    "rollout/backpressure_s",
    "rollout/vllm_retry_count",
    "rollout/vllm_kv_cache_usage_frac",
    "rollout/vllm_running_requests",
    "rollout/vllm_queued_requests",
    "rollout/vllm_preemption_count",
    # ---- tools ------------------------------------------------------------------------------------------------------
    "tools/latency_s",
    "tools/{tool}/latency_s",
    "tools/{tool}/call_count",
    "tools/{tool}/failure_count",
    "tools/unknown_name_count",
    "tools/parallel_calls_mean",
    "tools/loop_exhausted_frac",
    # ---- environments -----------------------------------------------------------------------------------------------
    "env/reset_s",
    "env/reward_s",
    # ---- samples ----------------------------------------------------------------------------------------------------
    "sample/forwarded_tokens_mean",
    "sample/forwarded_tokens_max",
    "sample/trained_tokens_mean",
    "sample/time_in_queue_s",
    "sample/staleness_mean",
    "sample/staleness_max",
    "sample/dropped_stale_count",
    # ---- batches ----------------------------------------------------------------------------------------------------
    "batch/forwarded_tokens_per_step",
    "batch/trained_tokens_per_step",
    "batch/samples_per_step",
    "batch/groups_per_step",
    "batch/microbatches_per_step",
    "batch/masked_token_frac",
    "batch/samples_per_row",
    "batch/row_tokens_mean",
    "batch/row_tokens_max",
    "batch/row_fill_frac",
    "batch/row_imbalance",
    "batch/packing_ratio",
    "batch/pad_frac",
    "batch/dropped_oversize_count",
    # ---- performance ------------------------------------------------------------------------------------------------
    "perf/step_s",
    "perf/fwd_bwd_s",
    "perf/fwd_s",
    "perf/optimizer_s",
    "perf/rollout_wait_s",
    "perf/weight_sync_s",
    "perf/weight_sync_pause_s",
    "perf/weight_sync_barrier_s",
    "perf/weight_sync_transfer_s",
    "perf/fwd_bwd_forwarded_tokens_per_s",
    "perf/wall_clock_forwarded_tokens_per_s",
    "perf/wall_clock_trained_tokens_per_s",
    "perf/fwd_bwd_mfu",
    "perf/wall_clock_mfu",
)
"""The documented metrics, a `{placeholder}` standing for one path segment as in the catalogue."""

NOT_PRODUCED_HERE = {
    "perf/weight_sync_barrier_s": "the wait for the other ranks before a sync: only a run of several processes has "
    "one; tests/distributed/test_torchrun.py::test_torchrun_tandem_train_through_the_embedded_server checks it in "
    "every step's line of a two-rank torchrun",
}
"""Documented metrics no short CPU run of one process writes: why, and the test that checks them instead."""

WRITTEN_BY_THE_AGENT_RUN = {
    "tools/call_frequency",
    "tools/failure_frequency",
    "tools/latency_s",
    "tools/{tool}/latency_s",
    "tools/{tool}/call_count",
    "tools/{tool}/failure_count",
    "tools/unknown_name_count",
    "tools/parallel_calls_mean",
    "tools/loop_exhausted_frac",
    "env/reset_s",
    "env/reward_s",
    "rollout/fork_frac",
    "rollout/drift_tokens_mean",
    "rollout/drift_tokens_max",
}
"""Logged only where rollouts call tools, in an environment, over several turns."""

WRITTEN_BY_THE_MOE_RUN = {"aux_loss", "batch/dropped_oversize_count"}
"""Logged only for a model with a router (its load-balancing loss), and when a sample exceeds token_budget."""

WRITTEN_BY_THE_GRPO_RUN = (
    set(DOCUMENTED_METRICS) - WRITTEN_BY_THE_AGENT_RUN - WRITTEN_BY_THE_MOE_RUN - set(NOT_PRODUCED_HERE)
)
"""Everything else: a plain GRPO run writes it, given time for one poll of the server's load and a stale sample."""

STAND_IN_PEAK_FLOPS = 1e12
"""The peak FLOP/s the MFU metrics divide by, as the trainer knows it for a GPU (tests/trainer/test_flops.py checks
those peaks, and that a CPU has none: then MFU is not logged)."""


def assert_written(tmp_path, run: str, expected: set[str]) -> None:
    """Every name of `expected` (a pattern found by any name it matches) is in at least one line of the run's
    metrics.jsonl."""
    written = {find(name).name for line in logged(tmp_path) for name in line if find(name) is not None}
    missing = sorted(expected - written)
    assert not missing, (
        f"the {run} wrote no line of {tmp_path / 'run' / 'metrics.jsonl'} with these documented metrics: {missing}"
    )


def test_every_documented_metric_is_in_the_catalogue_and_checked_by_one_run_here_or_named_elsewhere():
    unknown = [name for name in DOCUMENTED_METRICS if find(name) is None or find(name).name != name]
    assert not unknown, f"documented metrics the catalogue (tandem/metrics/catalogue/) lacks: {unknown}"
    assert len(set(DOCUMENTED_METRICS)) == len(DOCUMENTED_METRICS), "a documented metric is listed twice"
    conditional = [WRITTEN_BY_THE_AGENT_RUN, WRITTEN_BY_THE_MOE_RUN, set(NOT_PRODUCED_HERE)]
    stray = set().union(*conditional) - set(DOCUMENTED_METRICS)
    assert not stray, f"names given to a run or to NOT_PRODUCED_HERE that are not documented metrics: {sorted(stray)}"
    assert sum(map(len, conditional)) == len(set().union(*conditional)), "a documented metric is given to two places"


@pytest.mark.parametrize("name", sorted(NOT_PRODUCED_HERE))
def test_what_no_run_here_writes_is_checked_by_the_test_named(name):
    path, test = re.search(r"(tests/\S+\.py)::(\w+)", NOT_PRODUCED_HERE[name]).groups()
    source = (ROOT / path).read_text()
    assert f"def {test}(" in source, f"{path} has no {test} (renamed?): NOT_PRODUCED_HERE[{name!r}] is out of date"
    body = source.split(f"def {test}(")[1].split("\ndef ")[0]
    assert f'"{name}"' in body, f"{path}::{test} does not check {name}"


class UntilLogged(TrainerCallback):
    """Stops the run once its lines have had each of `names`: metrics that only time or chance bring (the rollout
    worker polls the server's load every 5 s)."""

    def __init__(self, *names: str):
        self.waiting = set(names)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.waiting -= set(logs or {})
        control.should_training_stop = not self.waiting
        return control


def test_a_grpo_run_writes_the_metrics_of_training_generation_and_the_pipeline(tmp_path, monkeypatch):
    """The tiny model on arithmetic, with a reward some groups all pass or all fail (so groups are dropped), some
    completions ending on EOS and some cut off. At staleness 0, with generation and steps slowed, groups that straddle
    a sync arrive stale and are dropped. The run lasts until it has logged a stale drop and one poll of the server's
    load (at most 30 steps)."""
    monkeypatch.setattr("tandem.trainer.flops.peak_flops", lambda device, bf16: STAND_IN_PEAK_FLOPS)
    trainer = SlowLoopTrainer(
        "tiny",
        accuracy_reward,
        args=config(tmp_path, max_staleness=0, max_steps=30),
        train_dataset=small_dataset(96),
        callbacks=[UntilLogged("rollout/vllm_kv_cache_usage_frac", "sample/dropped_stale_count")],
    )
    trainer.train()
    assert_written(tmp_path, f"GRPO run ({trainer.state.global_step} steps)", WRITTEN_BY_THE_GRPO_RUN)


def test_an_agent_run_writes_the_tool_environment_and_multi_turn_metrics(tmp_path):
    """A self-sampling environment with a tool of its own, one more tool, and a loop that makes every reply call the
    tool (whatever the tiny model wrote): three turns a rollout, the last stopped at max_tool_calling_iterations."""
    trainer = AlwaysCallsTrainer(
        "tiny",
        random_reward,
        args=args(tmp_path, max_steps=2, max_completion_length=6),
        tools=[multiply],
        environment_factory=IncrementEnv,
    )
    trainer.train()
    assert_written(tmp_path, "agent run", WRITTEN_BY_THE_AGENT_RUN)


def test_an_moe_run_over_its_token_budget_writes_the_router_loss_and_the_oversize_drops(tmp_path, tokenizer):
    """A small random Qwen3-MoE trained with a router loss, on two prompts of different lengths, with a token budget
    the shorter prompt's samples fit and the longer one's exceed (unless the random model ends them early)."""
    questions = ["What is 2 + 3?", "What is 24 + 47?"]
    short, long = (len(chat_prompt(tokenizer, question)) for question in questions)
    assert short < long, "the questions render to prompts of different lengths"
    model = saved_with_tiny_tokenizer(BY_NAME["Qwen3-MoE"].build(), tmp_path / "moe")
    budget = short + 6  # a short-prompt sample of max_completion_length tokens fits, a long-prompt one does not
    settings = config(tmp_path, max_steps=2, max_completion_length=6, token_budget=budget, router_aux_loss_coef=0.01)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": question}]} for question in questions * 8])
    trainer = AsyncGRPOTrainer(model, varied_reward, args=settings, train_dataset=data)
    with pytest.warns(UserWarning, match=f"exceeds token_budget={budget}"):
        trainer.train()
    assert_written(tmp_path, "MoE run", WRITTEN_BY_THE_MOE_RUN)
