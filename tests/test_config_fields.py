"""The fields users bring from transformers' TrainingArguments: each one works, or is refused when set, saying why.
FIELD_TESTS maps every field that works to the test that shows it; the first tests keep that honest."""

import asyncio
import dataclasses
import json
import math
import multiprocessing as mp
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from rich.console import Console
from transformers import AutoModelForCausalLM, TrainerCallback

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
from tandem.config_checks import REFUSED, type_problem
from tandem.metrics.console import RunConsole
from tandem.model import distributed as tandem_distributed
from tandem.packing import pack
from tandem.packing.batching import TokenBudgetBatcher
from tandem.rewards import accuracy_reward
from tandem.rollout.prompt_stream import epoch_order
from tandem.runtime import embedded_server
from tandem.tasks import TINY_MODEL_PATH, arithmetic
from tandem.trainer.checkpoint import TrainerState
from tandem.trainer.objectives import make_objective
from tandem.trainer.optimization import make_optimizer, make_scheduler
from tests.packing.samples import sample
from tests.rollout.test_failures import ScriptedLoop, by_reply, run_loop
from tests.trainer.test_trainer import config, logged

ROOT = Path(__file__).resolve().parents[1]
DATA = Dataset.from_list(arithmetic.make_rows(4, seed=0))


def server_flags(trainer) -> list[str]:
    """The flags the trainer's embedded server is started with."""
    spec = trainer.runtime.spec
    return embedded_server.server_flags(spec.args, spec.model_name, spec.served_dtype, spec.lora_rank)


def non_default(item: dataclasses.Field):
    """A value of the field's type that is not its default."""
    default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
    for candidate in (True, 7, 0.5, "other", ["x"], {"x": 1}, False):
        if type_problem(candidate, item.type) is None and candidate != default:
            return candidate
    raise AssertionError(f"no non-default value found for {item.name}")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_field_set_to_anything_but_its_default_fails_with_the_reason(name):
    item = next(f for f in dataclasses.fields(AsyncGRPOConfig) if f.name == name)
    value = non_default(item)
    with pytest.raises(ValueError, match=rf"AsyncGRPOConfig\.{name}=.* is not supported: .*Leave it at"):
        AsyncGRPOConfig(**{name: value})
    AsyncGRPOConfig(**{name: getattr(AsyncGRPOConfig(), name)})  # its default is accepted


FIELD_TESTS = {
    "output_dir": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "per_device_train_batch_size": "tests/test_config_fields.py::test_per_device_train_batch_size_caps_the_samples_of_a_row",
    "num_train_epochs": "tests/trainer/test_trainer.py::test_stopped_and_resumed_at_a_random_point_a_run_finishes_every_prompt_exactly_once",
    "max_steps": "tests/trainer/test_trainer.py::test_a_curriculum_loop_runs",
    "learning_rate": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "lr_scheduler_type": "tests/test_config_fields.py::test_lr_scheduler_kwargs_reach_transformers_schedule_and_warmup_applies_to_constant",
    "lr_scheduler_kwargs": "tests/test_config_fields.py::test_lr_scheduler_kwargs_reach_transformers_schedule_and_warmup_applies_to_constant",
    "warmup_steps": "tests/test_config_fields.py::test_lr_scheduler_kwargs_reach_transformers_schedule_and_warmup_applies_to_constant",
    "optim": "tests/test_config_fields.py::test_transformers_optimizer_names_build_their_optimizers_with_decay_spared_on_biases_and_norms",
    "optim_args": "tests/test_config_fields.py::test_transformers_optimizer_names_build_their_optimizers_with_decay_spared_on_biases_and_norms",
    "optim_target_modules": "tests/test_config_fields.py::test_optim_target_modules_projects_those_weights_with_galore_or_apollo",
    "weight_decay": "tests/test_config_fields.py::test_transformers_optimizer_names_build_their_optimizers_with_decay_spared_on_biases_and_norms",
    "adam_beta1": "tests/test_config_fields.py::test_transformers_optimizer_names_build_their_optimizers_with_decay_spared_on_biases_and_norms",
    "adam_beta2": "tests/test_config_fields.py::test_transformers_optimizer_names_build_their_optimizers_with_decay_spared_on_biases_and_norms",
    "adam_epsilon": "tests/test_config_fields.py::test_transformers_optimizer_names_build_their_optimizers_with_decay_spared_on_biases_and_norms",
    "gradient_accumulation_steps": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "max_grad_norm": "tests/trainer/test_optimization.py::test_max_grad_norm_zero_means_no_clipping_and_accumulation_equals_the_full_batch",
    "bf16": "tests/test_config_fields.py::test_bf16_autocasts_the_trainers_forward_and_leaves_the_weights_in_float32",
    "fp16": "tests/test_config_fields.py::test_fp16_and_tf32_are_refused_on_the_cpu_with_the_reason",
    "tf32": "tests/test_config_fields.py::test_fp16_and_tf32_are_refused_on_the_cpu_with_the_reason",
    "gradient_checkpointing": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "gradient_checkpointing_kwargs": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "use_cpu": "tests/test_config_fields.py::test_use_cpu_keeps_the_model_on_the_cpu_where_cuda_is_available",
    "logging_strategy": "tests/test_config_fields.py::test_logging_strategy_no_logs_no_step_and_logging_first_step_logs_the_first",
    "logging_steps": "tests/test_config_fields.py::test_epoch_and_fractional_strategies_empty_cache_steps_memory_metrics_and_ddp_timeout_work_as_in_transformers",
    "logging_first_step": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "logging_nan_inf_filter": "tests/trainer/test_logging_and_saving_fields.py::test_logging_nan_inf_filter_false_logs_a_nan_loss_instead_of_leaving_it_out",
    "include_num_input_tokens_seen": "tests/trainer/test_logging_and_saving_fields.py::test_a_run_logs_num_input_tokens_seen_and_a_checkpoint_keeps_it_with_save_on_each_node",
    "save_on_each_node": "tests/trainer/test_logging_and_saving_fields.py::test_save_on_each_node_stops_a_run_over_several_machines",
    "auto_find_batch_size": "tests/trainer/test_auto_find_batch_size.py::test_a_step_out_of_memory_runs_again_in_rows_of_half_the_tokens_and_the_budget_stays_halved",
    "log_level": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "log_level_replica": "tests/test_config_fields.py::test_full_determinism_turns_on_deterministic_algorithms_and_log_levels_pick_the_rank_and_node",
    "disable_tqdm": "tests/test_config_fields.py::test_disable_tqdm_prints_plain_lines_even_in_a_terminal",
    "report_to": "tests/metrics/test_sinks.py::test_report_to_all_sends_every_metric_and_the_completions_table_to_tensorboard_wandb_and_trackio",
    "run_name": "tests/metrics/test_sinks.py::test_report_to_all_sends_every_metric_and_the_completions_table_to_tensorboard_wandb_and_trackio",
    "project": "tests/metrics/test_sinks.py::test_report_to_all_sends_every_metric_and_the_completions_table_to_tensorboard_wandb_and_trackio",
    "trackio_space_id": "tests/metrics/test_sinks.py::test_a_hosted_trackio_run_goes_to_its_space_and_bucket_and_is_frozen_when_it_ends",
    "trackio_bucket_id": "tests/metrics/test_sinks.py::test_a_hosted_trackio_run_goes_to_its_space_and_bucket_and_is_frozen_when_it_ends",
    "trackio_static_space_id": "tests/metrics/test_sinks.py::test_a_hosted_trackio_run_goes_to_its_space_and_bucket_and_is_frozen_when_it_ends",
    "save_strategy": "tests/trainer/test_saving.py::test_save_strategy_best_and_save_only_model_keep_the_best_model_and_load_best_model_at_end_loads_it",
    "save_steps": "tests/test_config_fields.py::test_epoch_and_fractional_strategies_empty_cache_steps_memory_metrics_and_ddp_timeout_work_as_in_transformers",
    "save_total_limit": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "enable_jit_checkpoint": "tests/trainer/test_trainer.py::test_sigterm_with_enable_jit_checkpoint_saves_the_step_it_ends_and_exits_as_terminated",
    "resume_from_checkpoint": "tests/trainer/test_trainer.py::test_lora_training_syncs_versioned_adapters_and_samples_from_them",
    "seed": "tests/test_config_fields.py::test_train_sampling_strategy_random_orders_each_epoch_by_data_seed_or_seed",
    "data_seed": "tests/test_config_fields.py::test_train_sampling_strategy_random_orders_each_epoch_by_data_seed_or_seed",
    "train_sampling_strategy": "tests/test_config_fields.py::test_train_sampling_strategy_random_orders_each_epoch_by_data_seed_or_seed",
    "full_determinism": "tests/test_config_fields.py::test_full_determinism_turns_on_deterministic_algorithms_and_log_levels_pick_the_rank_and_node",
    "remove_unused_columns": "tests/test_config_fields.py::test_remove_unused_columns_keeps_the_prompt_and_the_columns_rewards_name",
    "model_init_kwargs": "tests/test_config_fields.py::test_dtype_loads_the_weights_in_it_and_model_init_kwargs_takes_precedence",
    "dtype": "tests/test_config_fields.py::test_dtype_loads_the_weights_in_it_and_model_init_kwargs_takes_precedence",
    "trust_remote_code": "tests/test_config_fields.py::test_trust_remote_code_loads_a_model_that_ships_its_own_code",
    "router_aux_loss_coef": "tests/test_config_fields.py::test_router_aux_loss_coef_overrides_the_models_own_and_needs_a_mixture_of_experts",
    "fsdp_config": "tests/test_config_and_cli.py::test_fsdp_config_takes_reshard_after_forward_and_refuses_the_rest",
    "num_generations": "tests/trainer/test_trainer.py::test_flash_reinforce_trains_exactly_b_single_rollouts_a_step_with_the_batch_baseline",
    "max_completion_length": "tests/test_config_and_cli.py::test_dry_run_prints_the_recipe_and_the_server_commands",
    "temperature": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "top_p": "tests/trainer/test_trainer.py::test_top_k_top_p_ratios_are_exact_with_sampling_masks_and_biased_without",
    "top_k": "tests/trainer/test_trainer.py::test_top_k_top_p_ratios_are_exact_with_sampling_masks_and_biased_without",
    "min_p": "tests/test_config_fields.py::test_the_sampling_fields_reach_every_request",
    "repetition_penalty": "tests/test_config_fields.py::test_the_sampling_fields_reach_every_request",
    "chat_template_kwargs": "tests/test_config_fields.py::test_chat_template_kwargs_reach_the_rendered_prompts",
    "max_tool_calling_iterations": "tests/rollout/test_agents.py::test_the_iteration_cap_stops_a_rollout_that_keeps_calling_and_it_is_still_trained",
    "tool_call_timeout": "tests/rollout/test_agents.py::test_each_tool_failure_is_an_error_message_to_the_model_and_a_counted_failure",
    "tool_call_parser": "tests/rollout/test_agents.py::test_tool_call_parser_reads_replies_in_the_models_own_format",
    "vllm_server_base_url": "tests/trainer/test_trainer.py::test_lora_against_a_server_without_adapters_syncs_merged_weights_with_a_warning",
    "vllm_server_timeout": "tests/trainer/test_trainer.py::test_unreachable_server_is_named",
    "vllm_server_api_key": "tests/test_config_and_cli.py::test_the_api_key_is_read_from_the_environment_and_masked_in_logs",
    "vllm_server_host": "tests/test_trl_recipes.py::test_trl_server_host_and_port_name_the_server_to_generate_from",
    "vllm_server_port": "tests/test_trl_recipes.py::test_trl_server_host_and_port_name_the_server_to_generate_from",
    "embedded_server_host": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "weight_transfer_address": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "algorithm": "tests/trainer/test_trainer.py::test_flash_reinforce_trains_exactly_b_single_rollouts_a_step_with_the_batch_baseline",
    "flash_delta": "tests/trainer/test_objectives.py::test_make_objective_follows_the_config",
    "flash_negative_token_fraction": "tests/test_config_fields.py::test_the_objective_takes_its_bounds_and_flash_fields_from_the_config",
    "flash_batch_size": "tests/trainer/test_trainer.py::test_flash_reinforce_trains_exactly_b_single_rollouts_a_step_with_the_batch_baseline",
    "epsilon": "tests/trainer/test_objectives.py::test_make_objective_follows_the_config",
    "epsilon_high": "tests/trainer/test_objectives.py::test_make_objective_follows_the_config",
    "score_centering": "tests/trainer/test_objectives.py::test_make_objective_follows_the_config",
    "vllm_importance_sampling_clip_min": "tests/test_config_fields.py::test_the_objective_takes_its_bounds_and_flash_fields_from_the_config",
    "vllm_importance_sampling_clip_max": "tests/test_config_fields.py::test_the_objective_takes_its_bounds_and_flash_fields_from_the_config",
    "vllm_importance_sampling_mode": "tests/test_config_fields.py::test_the_objective_takes_its_bounds_and_flash_fields_from_the_config",
    "importance_sampling_level": "tests/test_config_fields.py::test_the_objective_takes_its_bounds_and_flash_fields_from_the_config",
    "in_flight_weight_updates": "tests/trainer/test_trainer.py::test_in_flight_weight_updates_judge_a_group_by_its_tokens_and_never_past_max_staleness",
    "recompute_kv_cache_after_weight_updates": "tests/trainer/test_trainer.py::test_the_embedded_server_recomputes_its_cache_after_each_sync_when_asked",
    "num_sampler_logprobs": "tests/test_config_fields.py::test_the_sampling_fields_reach_every_request",
    "token_budget": "tests/trainer/test_trainer.py::test_samples_longer_than_the_token_budget_are_dropped_with_a_warning",
    "tree_attention_kernel": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "max_concurrent_rollouts": "tests/test_config_fields.py::test_max_concurrent_rollouts_caps_the_loop_and_the_embedded_servers_batch",
    "max_staleness": "tests/trainer/test_trainer.py::test_staleness_is_bounded_stale_samples_are_dropped_and_the_allowance_holds",
    "weight_sync_steps": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "weight_sync_check_atol": "tests/trainer/test_trainer.py::test_lora_training_syncs_versioned_adapters_and_samples_from_them",
    "rollout_worker_timeout": "tests/trainer/test_trainer.py::test_a_hung_worker_is_detected_by_its_heartbeat",
    "reward_timeout": "tests/rollout/test_failures.py::test_a_reward_function_past_reward_timeout_counts_as_a_failure",
    "stall_timeout": "tests/trainer/test_trainer.py::test_a_reward_that_never_varies_is_said_and_stops_the_run_instead_of_a_silent_wait",
    "log_completions": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "num_completions_to_print": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "eval_strategy": "tests/test_config_fields.py::test_epoch_and_fractional_strategies_empty_cache_steps_memory_metrics_and_ddp_timeout_work_as_in_transformers",
    "eval_steps": "tests/test_config_fields.py::test_epoch_and_fractional_strategies_empty_cache_steps_memory_metrics_and_ddp_timeout_work_as_in_transformers",
    "eval_delay": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "eval_on_start": "tests/trainer/test_conventions.py::test_a_run_evaluates_logs_and_optimizes_the_way_transformers_users_ask",
    "torch_compile": "tests/test_config_fields.py::test_torch_compile_compiles_the_decoder_once_for_rows_of_any_length",
    "torch_compile_backend": "tests/test_config_fields.py::test_torch_compile_compiles_the_decoder_once_for_rows_of_any_length",
    "torch_compile_mode": "tests/test_config_fields.py::test_torch_compile_mode_and_backend_reach_torch_compile",
    "torch_empty_cache_steps": "tests/test_config_fields.py::test_epoch_and_fractional_strategies_empty_cache_steps_memory_metrics_and_ddp_timeout_work_as_in_transformers",
    "log_on_each_node": "tests/test_config_fields.py::test_full_determinism_turns_on_deterministic_algorithms_and_log_levels_pick_the_rank_and_node",
    "save_only_model": "tests/trainer/test_saving.py::test_save_strategy_best_and_save_only_model_keep_the_best_model_and_load_best_model_at_end_loads_it",
    "push_to_hub": "tests/trainer/test_saving.py::test_push_to_hub_uploads_in_the_background_retries_never_writes_the_token_and_callbacks_resume_their_state",
    "hub_token": "tests/trainer/test_saving.py::test_push_to_hub_uploads_in_the_background_retries_never_writes_the_token_and_callbacks_resume_their_state",
    "hub_private_repo": "tests/trainer/test_saving.py::test_push_to_hub_uploads_in_the_background_retries_never_writes_the_token_and_callbacks_resume_their_state",
    "hub_model_id": "tests/trainer/test_saving.py::test_push_to_hub_uploads_in_the_background_retries_never_writes_the_token_and_callbacks_resume_their_state",
    "hub_strategy": "tests/trainer/test_saving.py::test_hub_always_push_queues_a_checkpoint_while_an_upload_runs_and_hub_strategy_picks_the_folders",
    "hub_always_push": "tests/trainer/test_saving.py::test_hub_always_push_queues_a_checkpoint_while_an_upload_runs_and_hub_strategy_picks_the_folders",
    "hub_revision": "tests/trainer/test_saving.py::test_push_to_hub_uploads_in_the_background_retries_never_writes_the_token_and_callbacks_resume_their_state",
    "load_best_model_at_end": "tests/trainer/test_saving.py::test_save_strategy_best_and_save_only_model_keep_the_best_model_and_load_best_model_at_end_loads_it",
    "metric_for_best_model": "tests/trainer/test_saving.py::test_save_strategy_best_and_save_only_model_keep_the_best_model_and_load_best_model_at_end_loads_it",
    "greater_is_better": "tests/trainer/test_saving.py::test_save_strategy_best_and_save_only_model_keep_the_best_model_and_load_best_model_at_end_loads_it",
    "restore_callback_states_from_checkpoint": "tests/trainer/test_saving.py::test_push_to_hub_uploads_in_the_background_retries_never_writes_the_token_and_callbacks_resume_their_state",
    "ddp_timeout": "tests/test_config_fields.py::test_epoch_and_fractional_strategies_empty_cache_steps_memory_metrics_and_ddp_timeout_work_as_in_transformers",
    "debug": "tests/test_config_fields.py::test_debug_underflow_overflow_stops_at_the_first_inf_with_transformers_report",
    "skip_memory_metrics": "tests/test_config_fields.py::test_epoch_and_fractional_strategies_empty_cache_steps_memory_metrics_and_ddp_timeout_work_as_in_transformers",
}
"""Each field that works -> the test that shows it working (a refused field's test is the parametrized one above)."""


def test_every_field_works_with_a_test_that_exists_or_is_refused():
    fields = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    assert not set(FIELD_TESTS) & set(REFUSED), f"both working and refused: {sorted(set(FIELD_TESTS) & set(REFUSED))}"
    missing = fields - set(FIELD_TESTS) - set(REFUSED)
    assert not missing, f"fields with neither a test nor a refusal: {sorted(missing)}"
    assert set(FIELD_TESTS) <= fields, f"not fields: {sorted(set(FIELD_TESTS) - fields)}"
    for name, where in FIELD_TESTS.items():
        path, _, test = where.partition("::")
        source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
        assert re.search(rf"^(async )?def {re.escape(test)}\(", source, re.M), f"{name}: no test {where}"


@pytest.mark.parametrize(
    "optim, optim_args, expected",
    [
        ("adamw_torch", None, torch.optim.AdamW),
        ("adamw_torch_fused", None, torch.optim.AdamW),
        ("adafactor", None, "Adafactor"),
        ("sgd", "momentum=0.9", torch.optim.SGD),
    ],
)
def test_transformers_optimizer_names_build_their_optimizers_with_decay_spared_on_biases_and_norms(
    optim, optim_args, expected
):
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH)
    optimizer = make_optimizer(
        model,
        AsyncGRPOConfig(
            optim=optim, optim_args=optim_args, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6
        ),
    )
    assert isinstance(optimizer, expected) if isinstance(expected, type) else type(optimizer).__name__ == expected
    decayed, spared = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and spared["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("norm" in names[id(p)] or "bias" in names[id(p)] for p in spared["params"])
    assert len(decayed["params"]) + len(spared["params"]) == len(list(model.parameters()))
    if optim_args:
        assert decayed["momentum"] == 0.9
    if optim.startswith("adamw"):
        assert (decayed["betas"], decayed["eps"]) == ((0.8, 0.95), 1e-6)
    if optim == "adamw_torch_fused":
        assert decayed["fused"]


def test_an_unknown_optimizer_name_says_which_names_work():
    with pytest.raises(ValueError, match="optim='adamw_typo'.*adamw_torch_fused"):
        make_optimizer(torch.nn.Linear(2, 2), AsyncGRPOConfig(optim="adamw_typo"))


def lrs(args: AsyncGRPOConfig) -> list[float]:
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=args.learning_rate)
    scheduler, seen = make_scheduler(optimizer, args), []
    for _ in range(args.max_steps):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return seen


def test_lr_scheduler_kwargs_reach_transformers_schedule_and_warmup_applies_to_constant():
    floor = lrs(
        AsyncGRPOConfig(
            learning_rate=1.0,
            max_steps=11,
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs='{"min_lr_rate": 0.25}',
        )
    )  # a JSON string, as transformers takes
    assert floor[0] == 1.0 and floor[-1] == pytest.approx(
        0.25 + 0.75 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * 10 / 11)).item())
    )
    assert min(floor) >= 0.25, "min_lr_rate keeps the rate at a quarter"
    assert lrs(AsyncGRPOConfig(learning_rate=1.0, max_steps=4, warmup_steps=2)) == [0.0, 0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="the 'constant' schedule takes none"):
        AsyncGRPOConfig(lr_scheduler_kwargs={"min_lr_rate": 0.1})
    with pytest.raises(ValueError, match="must be one of linear, cosine"):
        AsyncGRPOConfig(lr_scheduler_type="cosine_typo", max_steps=4)


def test_mapping_fields_take_json_strings_as_transformers_does():
    args = AsyncGRPOConfig(
        gradient_checkpointing_kwargs='{"use_reentrant": true}', model_init_kwargs='{"revision": "main"}'
    )
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": True} and args.model_init_kwargs == {
        "revision": "main"
    }
    with pytest.raises(ValueError, match="gradient_checkpointing_kwargs=.*JSON object"):
        AsyncGRPOConfig(gradient_checkpointing_kwargs="use_reentrant")


def test_fp16_and_tf32_are_refused_on_the_cpu_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="fp16=True needs a GPU"):
        AsyncGRPOTrainer(
            "tiny", accuracy_reward, args=AsyncGRPOConfig(output_dir=str(tmp_path), fp16=True), train_dataset=DATA
        )
    with pytest.raises(ValueError, match="tf32=True needs an Ampere or newer"):
        AsyncGRPOTrainer(
            "tiny", accuracy_reward, args=AsyncGRPOConfig(output_dir=str(tmp_path), tf32=True), train_dataset=DATA
        )
    with pytest.raises(ValueError, match="fp16 and bf16 cannot both be set"):
        AsyncGRPOConfig(fp16=True, bf16=True)


def test_use_cpu_keeps_the_model_on_the_cpu_where_cuda_is_available(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    trainer = AsyncGRPOTrainer(
        "tiny", accuracy_reward, args=AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True), train_dataset=DATA
    )
    assert trainer.device.type == "cpu"


def test_trust_remote_code_loads_a_model_that_ships_its_own_code(tmp_path):
    folder = tmp_path / "custom"
    shutil.copytree(TINY_MODEL_PATH, folder)
    (folder / "custom_model.py").write_text(
        "from transformers import Qwen2Config, Qwen2ForCausalLM\n\n\n"
        "class CustomConfig(Qwen2Config):\n    model_type = 'tandem_custom'\n\n\n"
        "class CustomForCausalLM(Qwen2ForCausalLM):\n    config_class = CustomConfig\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config |= {
        "model_type": "tandem_custom",
        "architectures": ["CustomForCausalLM"],
        "auto_map": {
            "AutoConfig": "custom_model.CustomConfig",
            "AutoModelForCausalLM": "custom_model.CustomForCausalLM",
        },
    }
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code"):
        AsyncGRPOTrainer(
            str(folder), accuracy_reward, args=AsyncGRPOConfig(output_dir=str(tmp_path)), train_dataset=DATA
        )
    trainer = AsyncGRPOTrainer(
        str(folder),
        accuracy_reward,
        train_dataset=DATA,
        args=AsyncGRPOConfig(output_dir=str(tmp_path), trust_remote_code=True),
    )
    assert type(trainer.model).__name__ == "CustomForCausalLM"
    assert "--trust-remote-code" in server_flags(trainer), "the embedded server loads the same code"


def test_remove_unused_columns_keeps_the_prompt_and_the_columns_rewards_name(tmp_path):
    def exact_answer(completions, solution, **kwargs):
        return [0.0 for _ in completions]

    rows = Dataset.from_list([{**row, "note": "unused", "source": "x"} for row in arithmetic.make_rows(4, seed=0)])
    kept = AsyncGRPOTrainer(
        "tiny",
        exact_answer,
        train_dataset=rows,
        args=AsyncGRPOConfig(output_dir=str(tmp_path), remove_unused_columns=True),
    ).dataset
    assert kept.column_names == ["prompt", "solution"]
    untouched = AsyncGRPOTrainer(
        "tiny", exact_answer, train_dataset=rows, args=AsyncGRPOConfig(output_dir=str(tmp_path))
    ).dataset
    assert set(untouched.column_names) == {"prompt", "solution", "note", "source"}


def test_per_device_train_batch_size_caps_the_samples_of_a_row():
    prompt = [1, 2, 3, 4]
    batcher = TokenBudgetBatcher(token_budget=1000, num_rows=2, max_samples=1)
    assert batcher.offer(sample(prompt + [5], [0] * 4 + [1], group=0))
    assert batcher.offer(sample(prompt + [6], [0] * 4 + [1], group=0))  # the second row: its group's row is full
    assert not batcher.offer(sample(prompt + [7], [0] * 4 + [1], group=0))
    assert [len(row.samples) for row in batcher.close()] == [1, 1]


def test_disable_tqdm_prints_plain_lines_even_in_a_terminal(capsys):
    console = Console(force_terminal=True, width=120, record=True)
    progress = RunConsole(10, console=console, dashboard=False)
    progress.update(1, {"reward": 0.5})
    assert progress.live is None and "reward" in console.export_text()


class OrderedLoop(ScriptedLoop):
    """Writes down the dataset rows in the order the loop takes them."""

    taken: list[int] = []

    def filter_prompt(self, row_index, row, epoch):
        OrderedLoop.taken.append(row_index)
        return True


@pytest.mark.parametrize("strategy, data_seed", [("sequential", None), ("random", 7), ("random", 8), ("random", None)])
def test_train_sampling_strategy_random_orders_each_epoch_by_data_seed_or_seed(strategy, data_seed):
    OrderedLoop.taken = []
    run_loop(by_reply, prompts=6, loop_cls=OrderedLoop, train_sampling_strategy=strategy, data_seed=data_seed, seed=5)
    expected = list(range(6)) if strategy == "sequential" else epoch_order(5 if data_seed is None else data_seed, 0, 6)
    assert OrderedLoop.taken == expected and sorted(expected) == list(range(6))
    assert epoch_order(7, 0, 6) != epoch_order(8, 0, 6) != list(range(6)) and epoch_order(7, 1, 6) != epoch_order(
        7, 0, 6
    )


def test_the_objective_takes_its_bounds_and_flash_fields_from_the_config():
    objective = make_objective(
        AsyncGRPOConfig(vllm_importance_sampling_clip_min=0.25, vllm_importance_sampling_clip_max=2.0), 0.0
    )
    assert (objective.rule.clip_min, objective.rule.clip_max) == (0.25, 2.0)
    gspo = make_objective(
        AsyncGRPOConfig(
            score_centering=False, importance_sampling_level="sequence", vllm_importance_sampling_mode="geometric_mask"
        ),
        0.0,
    )
    assert (gspo.rule.level, gspo.rule.mode) == ("sequence", "geometric_mask")
    flash = make_objective(
        AsyncGRPOConfig(algorithm="flash_reinforce", num_generations=1, flash_negative_token_fraction=0.3), 0.0
    )
    assert flash.negative_token_fraction == 0.3


def test_router_aux_loss_coef_overrides_the_models_own_and_needs_a_mixture_of_experts(tmp_path):
    from transformers import AutoTokenizer, Qwen2MoeConfig

    moe = AutoModelForCausalLM.from_config(
        Qwen2MoeConfig(
            vocab_size=400,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.01,
            max_position_embeddings=64,
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)

    def build(model, **args):
        return AsyncGRPOTrainer(
            model,
            accuracy_reward,
            train_dataset=DATA,
            processing_class=tokenizer,
            args=AsyncGRPOConfig(output_dir=str(tmp_path), **args),
        )

    assert build(moe).objective.aux_loss_coef == 0.01, "the model's own coefficient by default"
    assert build(moe, router_aux_loss_coef=0.5).objective.aux_loss_coef == 0.5
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.5: the model is not a Mixture-of-Experts"):
        build("tiny", router_aux_loss_coef=0.5)


def test_dtype_loads_the_weights_in_it_and_model_init_kwargs_takes_precedence(tmp_path):
    def build(**args):
        return AsyncGRPOTrainer(
            "tiny", accuracy_reward, train_dataset=DATA, args=AsyncGRPOConfig(output_dir=str(tmp_path), **args)
        )

    bf16 = build(dtype="bfloat16")
    assert bf16.device.type == "cpu" and next(bf16.model.parameters()).dtype == torch.bfloat16
    assert "--dtype bfloat16" in " ".join(server_flags(bf16)), "the embedded server samples in the same dtype"
    assert (
        next(build(dtype="bfloat16", model_init_kwargs={"dtype": "float16"}).model.parameters()).dtype == torch.float16
    )


def test_bf16_autocasts_the_trainers_forward_and_leaves_the_weights_in_float32(tmp_path):
    row = pack([sample([5, 6, 7, 8, 9, 10, 11, 12])])

    def build(**args):
        return AsyncGRPOTrainer(
            "tiny", accuracy_reward, train_dataset=DATA, args=AsyncGRPOConfig(output_dir=str(tmp_path), **args)
        )

    mixed, plain = build(bf16=True), build(bf16=False)
    assert next(mixed.model.parameters()).dtype == torch.float32
    exact = plain.passes.score(row).log_probs
    torch.testing.assert_close(plain.passes.forward(row).log_probs, exact, rtol=0, atol=0)
    gap = (mixed.passes.forward(row).log_probs.float() - exact).abs().max()
    assert 1e-5 < gap < 0.5, f"bf16 rounds the forward a little ({gap})"


def rollout_loop(args: AsyncGRPOConfig, tokenizer=None):
    """The rollout loop built in-process, as the worker builds it (no server behind its address)."""
    from transformers import AutoTokenizer

    from tandem import AsyncRolloutLoop
    from tandem.contract.channels import Channels
    from tandem.rollout.settings import RolloutSettings

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    settings = RolloutSettings(
        config=args,
        model_name="tiny",
        tokenizer_path=TINY_MODEL_PATH,
        dataset=DATA,
        reward_funcs=[accuracy_reward],
        eos_token_ids=[tokenizer.eos_token_id],
        base_url="http://127.0.0.1:9",
    )
    return AsyncRolloutLoop(settings, processing_class=tokenizer, channels=Channels.create(mp.get_context("spawn")))


def test_the_sampling_fields_reach_every_request(tmp_path):
    loop = rollout_loop(
        AsyncGRPOConfig(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.2, num_sampler_logprobs=3)
    )
    sent = {}

    async def complete(prompt_ids, **fields):
        sent.update(fields)
        return []

    loop._scheduler.generation.client.complete = complete
    asyncio.run(loop._scheduler.generation.sample([5, 6, 7], n=2))
    assert {k: sent[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "logprobs", "n")} == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "logprobs": 3,
        "n": 2,
    }


def test_chat_template_kwargs_reach_the_rendered_prompts(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    tokenizer.chat_template = "{{ persona | default('plain') }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rendered = {}
    for kwargs in (None, {"persona": "tutor"}):
        loop = rollout_loop(AsyncGRPOConfig(chat_template_kwargs=kwargs), tokenizer)
        rendered[bool(kwargs)] = tokenizer.decode(loop.render([{"role": "user", "content": "hi"}]))
    assert rendered == {False: "plain:hi", True: "tutor:hi"}


def test_logging_strategy_no_logs_no_step_and_logging_first_step_logs_the_first(tmp_path):
    def logged_steps(**args):
        trainer = AsyncGRPOTrainer(
            "tiny", accuracy_reward, train_dataset=DATA, args=AsyncGRPOConfig(output_dir=str(tmp_path), **args)
        )
        steps = []
        for step in range(1, 7):
            trainer.state.step = step
            steps += [step] if trainer.callbacks.log_due(epoch_ended=step == 5) else []
        return steps

    assert logged_steps(logging_steps=3) == [3, 6]
    assert logged_steps(logging_steps=3, logging_first_step=True) == [1, 3, 6]
    assert logged_steps(logging_strategy="no", logging_first_step=True) == []
    assert logged_steps(logging_steps=0.5, max_steps=6) == [3, 6], "below 1: a fraction of max_steps"
    assert logged_steps(logging_strategy="epoch") == [5]


class EpochWatch(TrainerCallback):
    """The passes over the dataset finished after each step (the first entry: before the first)."""

    def __init__(self):
        self.epochs, self.trainer = [0], None

    def on_step_end(self, args, state, control, **kwargs):
        self.epochs.append(self.trainer.state.dataset_start_index // len(self.trainer.dataset))


def test_epoch_and_fractional_strategies_empty_cache_steps_memory_metrics_and_ddp_timeout_work_as_in_transformers(
    tmp_path, monkeypatch
):
    emptied, timeouts = [], []
    monkeypatch.setattr("tandem.trainer.trainer.empty_device_cache", lambda device: emptied.append(trainer.state.step))
    join = tandem_distributed.join
    monkeypatch.setattr(tandem_distributed, "join", lambda timeout_s: timeouts.append(timeout_s) or join(timeout_s))
    prompts = Dataset.from_list(arithmetic.make_rows(12, seed=1))
    passes = EpochWatch()
    args = config(
        tmp_path,
        max_steps=6,
        logging_steps=0.5,
        eval_strategy="epoch",
        save_strategy="epoch",
        torch_empty_cache_steps=2,
        skip_memory_metrics=False,
        ddp_timeout=77,
        max_staleness=0,
    )
    trainer = AsyncGRPOTrainer(
        "tiny",
        accuracy_reward,
        args=args,
        train_dataset=prompts,
        eval_dataset=prompts.select(range(2)),
        callbacks=[passes],
    )
    passes.trainer = trainer
    trainer.train()
    rows = logged(tmp_path)
    assert [r["step"] for r in rows if "loss" in r] == [3, 6], "logging_steps=0.5 of max_steps=6: every 3 steps"
    ended = [step for step, before, after in zip(range(1, 7), passes.epochs, passes.epochs[1:]) if after > before]
    assert ended and [r["step"] for r in rows if "eval/reward" in r] == ended, "an epoch's end evaluates"
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "run").glob("checkpoint-*"))
    assert saved == sorted(set(ended) | {6}), "an epoch's end saves (and the run's end)"
    assert emptied == [2, 4, 6], "torch_empty_cache_steps"
    assert all(0.05 < r["memory/host_rss_max_gib"] < 64 for r in rows if "loss" in r), "skip_memory_metrics=False"
    assert timeouts == [77], "ddp_timeout bounds the process group's collectives"
    with pytest.raises(ValueError, match="save_strategy='epoch' needs a dataset with a length"):
        AsyncGRPOTrainer(
            "tiny",
            accuracy_reward,
            args=config(tmp_path, save_strategy="epoch"),
            train_dataset=prompts.to_iterable_dataset(),
        )


def test_nan_and_infinite_losses_are_left_out_of_the_logged_loss_unless_logging_nan_inf_filter_is_off():
    from tandem.trainer.run_log import RunLog
    from tandem.trainer.step_metrics import StepTimes

    rows, times = (
        [pack([sample([5, 6, 7])])],
        StepTimes(total=1.0, rollout_wait=0.0, forward=0.5, forward_backward=0.8, optimizer=0.1),
    )
    filtered = RunLog(AsyncGRPOConfig(logging_nan_inf_filter=True))
    kept = RunLog(AsyncGRPOConfig(logging_nan_inf_filter=False))
    for log in (filtered, kept):
        for loss in (0.5, float("nan"), float("inf")):
            log.record_step(rows, 1, loss, 1.0, 1e-6, times)
    assert filtered.window.values["loss"] == [0.5] and filtered.losses == [0.5]
    assert filtered.flush(TrainerState())[0]["loss"] == 0.5
    assert kept.flush(TrainerState())[0]["loss"] == float("inf") and math.isnan(kept.training_loss)


def test_full_determinism_turns_on_deterministic_algorithms_and_log_levels_pick_the_rank_and_node():
    from transformers.utils import logging as hf_logging

    from tandem.trainer.run_setup import run_log_level, set_log_level

    # In a process of its own: transformers' switch sets process-wide state (environment variables the servers and
    # workers started later inherit) that slowed every later test of this process by a quarter.
    code = (
        "import torch; from tandem.config import AsyncGRPOConfig; from tandem.trainer.run_setup import seed_run; "
        "seed_run(AsyncGRPOConfig()); print(torch.are_deterministic_algorithms_enabled()); "
        "seed_run(AsyncGRPOConfig(full_determinism=True)); print(torch.are_deterministic_algorithms_enabled())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]
    args = AsyncGRPOConfig(log_level="info", log_level_replica="error")
    levels = [run_log_level(args, main, local) for main, local in ((True, True), (False, True), (False, False))]
    assert levels == ["info", "info", "error"], "log_on_each_node (the default): each machine's first process logs"
    args = AsyncGRPOConfig(log_level="info", log_level_replica="error", log_on_each_node=False)
    assert run_log_level(args, False, True) == "error", "log_on_each_node=False: the job's first process alone"
    verbosity = hf_logging.get_verbosity()
    try:
        set_log_level("error")
        assert hf_logging.get_verbosity() == hf_logging.ERROR
        set_log_level("passive")
        assert hf_logging.get_verbosity() == hf_logging.ERROR, "passive leaves it alone"
    finally:
        hf_logging.set_verbosity(verbosity)


def test_max_concurrent_rollouts_caps_the_loop_and_the_embedded_servers_batch(tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_concurrent_rollouts=7)
    trainer = AsyncGRPOTrainer("tiny", accuracy_reward, train_dataset=DATA, args=args)
    assert "--max-num-seqs 7" in " ".join(server_flags(trainer))
    loop = rollout_loop(args)
    assert loop._scheduler.generation.cap.value == 7 and loop._scheduler.generation.runner.pool_size == 7


def test_evaluation_is_never_asked_for_without_prompts_nor_given_prompts_it_ignores(tmp_path):
    def build(eval_dataset=None, **args):
        return AsyncGRPOTrainer(
            "tiny",
            accuracy_reward,
            train_dataset=DATA,
            eval_dataset=eval_dataset,
            args=AsyncGRPOConfig(output_dir=str(tmp_path), **args),
        )

    with pytest.raises(ValueError, match="eval_strategy='steps' / eval_on_start=False needs an eval_dataset"):
        build(eval_strategy="steps")
    with pytest.warns(UserWarning, match="it is never evaluated"):
        build(DATA)
    with pytest.raises(ValueError, match="eval_dataset is an IterableDataset"):
        build(DATA.to_iterable_dataset(), eval_strategy="steps")
    with pytest.raises(ValueError, match="eval_dataset: eval_dataset has no 'prompt' column"):
        build(DATA.remove_columns("prompt"), eval_strategy="steps")


def test_a_dry_run_lists_the_changed_fields_the_api_key_too_and_a_warmup_fraction_needs_max_steps(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-the-environment")
    changed = AsyncGRPOConfig(vllm_server_api_key="my-own", max_steps=10).changed()
    assert changed == {"max_steps": 10, "vllm_server_api_key": "***"}, "masked, and listed although both mask alike"
    with pytest.raises(ValueError, match="warmup_steps=0.1: below 1 is a fraction of max_steps, which is not set"):
        AsyncGRPOConfig(warmup_steps=0.1)


def test_processing_class_pads_on_the_left_and_its_pad_token_falls_back_to_eos(tmp_path):
    from transformers import AutoTokenizer

    given = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    given.padding_side, given.pad_token = "right", None
    with pytest.warns(UserWarning, match="processing_class.padding_side='right': set to 'left'"):
        trainer = AsyncGRPOTrainer(
            "tiny",
            accuracy_reward,
            train_dataset=DATA,
            processing_class=given,
            args=AsyncGRPOConfig(output_dir=str(tmp_path)),
        )
    assert trainer.tokenizer is given and given.padding_side == "left" and given.pad_token == given.eos_token
    loaded = AsyncGRPOTrainer(
        "tiny", accuracy_reward, train_dataset=DATA, args=AsyncGRPOConfig(output_dir=str(tmp_path))
    )
    assert loaded.tokenizer.padding_side == "left", "the tokenizer loaded from the model too"


def test_top_p_and_min_p_need_top_k_at_construction():
    for truncation in ({"top_p": 0.9}, {"min_p": 0.05}):
        with pytest.raises(ValueError, match=r"top_k=0: top_p < 1 and min_p need top_k set too .* e.g. top_k=512"):
            AsyncGRPOConfig(**truncation)
        assert AsyncGRPOConfig(**truncation, top_k=512).uses_truncated_sampling
    assert not AsyncGRPOConfig(min_p=0.0).uses_truncated_sampling, "min_p 0 is off"


@pytest.mark.parametrize("optim, module", [("galore_adamw", "galore_torch"), ("apollo_adamw", "apollo_torch")])
def test_optim_target_modules_projects_those_weights_with_galore_or_apollo(optim, module):
    # Left out of the test extra: galore-torch and apollo-torch need bitsandbytes, which warns on every import of
    # transformers on a CPU. pip install 'tandem-rl[galore]' runs this (it passed where they were installed).
    pytest.importorskip(module, reason=f"{optim} needs pip install 'tandem-rl[galore]'")
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH)
    args = AsyncGRPOConfig(
        optim=optim, optim_target_modules=[r".*\.q_proj", r".*\.down_proj"], learning_rate=1e-2, weight_decay=0.1
    )
    optimizer = make_optimizer(model, args)
    assert type(optimizer).__module__.startswith(module)
    projected = [g for g in optimizer.param_groups if "rank" in g]
    assert projected and len(projected[0]["params"]) == 2 * model.config.num_hidden_layers, "q_proj and down_proj"
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    model(input_ids=torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss.backward()
    optimizer.step()
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight), "the projected weights train"


def test_debug_underflow_overflow_stops_at_the_first_inf_with_transformers_report(tmp_path):
    trainer = AsyncGRPOTrainer(
        "tiny",
        accuracy_reward,
        train_dataset=DATA,
        args=AsyncGRPOConfig(output_dir=str(tmp_path), debug="underflow_overflow"),
    )
    row = pack([sample([5, 6, 7, 8])])
    assert torch.isfinite(trainer.passes.forward(row).log_probs).all(), "finite activations pass"
    with torch.no_grad():
        trainer.model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="inf/nan"):
        trainer.passes.forward(row)
    with pytest.raises(ValueError, match="'tpu_metrics_debug' needs a TPU"):
        AsyncGRPOConfig(debug="underflow_overflow tpu_metrics_debug")


def test_torch_compile_compiles_the_decoder_once_for_rows_of_any_length(tmp_path):
    from torch._dynamo.utils import counters

    plain = AsyncGRPOTrainer(
        "tiny", accuracy_reward, train_dataset=DATA, args=AsyncGRPOConfig(output_dir=str(tmp_path))
    )
    with pytest.warns(UserWarning, match="no longer matches `tandem serve --decode-mode exact` bit for bit"):
        compiled = AsyncGRPOTrainer(
            "tiny",
            accuracy_reward,
            train_dataset=DATA,
            args=AsyncGRPOConfig(output_dir=str(tmp_path), torch_compile=True, torch_compile_backend="eager"),
        )  # dynamo's tracing, no codegen
    torch._dynamo.reset()
    counters.clear()
    for length in (12, 19, 31):  # packed rows change length every step: dynamic shapes, one graph
        row = pack(
            [sample(list(range(5, 5 + length)), group=0), sample(list(range(5, 5 + length - 4)) + [9] * 6, group=0)]
        )
        assert torch.equal(compiled.passes.forward(row).log_probs, plain.passes.forward(row).log_probs), length
    assert counters["stats"]["unique_graphs"] >= 1, "the decoder ran compiled"
    assert counters["stats"]["unique_graphs"] <= 2, f"recompiled for new lengths: {dict(counters['stats'])}"


def test_torch_compile_mode_and_backend_reach_torch_compile(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: asked.append(kwargs))
    with pytest.warns(UserWarning, match="no longer matches"):
        AsyncGRPOTrainer(
            "tiny",
            accuracy_reward,
            train_dataset=DATA,
            args=AsyncGRPOConfig(
                output_dir=str(tmp_path), torch_compile=True, torch_compile_mode="max-autotune-no-cudagraphs"
            ),
        )
    assert asked == [{"backend": "inductor", "mode": "max-autotune-no-cudagraphs", "dynamic": True}]


def test_optim_target_modules_without_a_low_rank_optimizer_says_which_optimizers_read_it():
    with pytest.raises(ValueError, match="optim_target_modules=.*read by the low-rank optimizers only"):
        AsyncGRPOConfig(optim_target_modules=["attn"])
