"""A recipe written for TRL's GRPO script, read in tandem's terms.

TRL's `trl grpo --config x.yaml` reads its keys into three dataclasses (the script's arguments, `ModelConfig` and
`GRPOConfig`). tandem's config already uses TRL's names wherever the two mean the same thing (`num_generations`,
`epsilon`, `vllm_server_base_url`, ...). The tables here cover the rest:

- `RENAMED`: TRL's name for one of tandem's keys, taken with a one-line note;
- `LORA`: `use_peft` and the `lora_*` keys, gathered into tandem's `lora` mapping;
- `NO_USE`: a TRL field with nothing to do in tandem. It is accepted at the values that describe what tandem does
  anyway (TRL's default, mostly), with a note saying why it is not read, and refused at any other value, saying why
  and what to write instead;
- `REWARDS`: TRL's built-in reward functions by their short names, as tandem's import paths.

`load_recipe` reads every recipe through `from_trl`; docs/migrating-from-trl.md renders these tables (a test keeps
them in step).
"""

from tandem.errors import UsageError

RENAMED = {
    "model_name_or_path": "model",
    "dataset_name": "dataset",
    "dataset_train_split": "dataset_split",
    "dataset_test_split": "eval_split",
}
"""TRL's name -> tandem's key for the same thing."""

LORA = {
    "lora_r": "r",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "lora_target_modules": "target_modules",
    "lora_target_parameters": "target_parameters",
    "lora_modules_to_save": "modules_to_save",
    "lora_task_type": "task_type",
    "use_rslora": "use_rslora",
    "use_dora": "use_dora",
}
"""TRL's `ModelConfig` LoRA keys -> the `peft.LoraConfig` field they set in tandem's `lora` mapping."""
LORA_DEFAULTS = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "task_type": "CAUSAL_LM"}
"""What TRL's `use_peft: true` trains with where its `lora_*` keys are not given (peft's own defaults differ)."""

SERVER = "generation runs on a server: the embedded tandem serve, or the one at vllm_server_base_url"
NO_REFERENCE = "tandem's objective has no KL penalty to a reference model, so none is loaded"
NO_ENTROPY = "tandem's objective has no entropy bonus"
NO_QUANTIZED = (
    "tandem trains the weights in dtype (float32, bfloat16 or float16); quantized training is not implemented"
)
SERVE_FLAG = "a setting of the generation server: start vllm serve with {flag} and give its URL as vllm_server_base_url"

NO_USE: dict[str, tuple[tuple, str]] = {
    # generation
    "use_vllm": ((True,), f"{SERVER}, always"),
    "vllm_mode": (("server",), f"{SERVER}; there is no engine colocated in the trainer's process"),
    "vllm_model_impl": (("vllm",), SERVE_FLAG.format(flag="--model-impl")),
    "vllm_gpu_memory_utilization": ((0.3,), SERVE_FLAG.format(flag="--gpu-memory-utilization")),
    "vllm_tensor_parallel_size": ((1,), SERVE_FLAG.format(flag="--tensor-parallel-size")),
    "vllm_max_model_length": (
        (None,),
        SERVE_FLAG.format(flag="--max-model-len") + "; the embedded server is sized from the longest prompt",
    ),
    "vllm_enable_sleep_mode": ((False,), "the server is a process of its own: it never shares the trainer's memory"),
    "vllm_group_port": (
        (51216,),
        "the weight-transfer group takes a free port itself (weight_transfer_address "
        "says where servers reach the trainer)",
    ),
    "vllm_structured_outputs_regex": ((None,), "guided decoding is not implemented"),
    "use_transformers_paged": ((False,), SERVER),
    "use_transformers_continuous_batching": ((False,), SERVER),
    "transformers_continuous_batching_config": ((None,), SERVER),
    "cache_implementation": ((None,), SERVER),
    "generation_kwargs": (
        (None,),
        "the sampling settings are fields of their own (temperature, top_p, top_k, min_p, repetition_penalty)",
    ),
    "generation_batch_size": ((None,), "generation never stops: max_concurrent_rollouts and max_staleness pace it"),
    "steps_per_generation": ((None,), "generation never stops: max_concurrent_rollouts and max_staleness pace it"),
    "ds3_gather_for_generation": ((True,), "tandem does not use DeepSpeed; weights reach the server at every sync"),
    "num_generations_eval": ((None,), "an eval prompt is answered num_generations times, as in training"),
    # the objective
    "beta": ((0.0,), NO_REFERENCE),
    "sync_ref_model": ((False,), NO_REFERENCE),
    "ref_model_mixup_alpha": ((0.6,), NO_REFERENCE),
    "ref_model_sync_steps": ((512,), NO_REFERENCE),
    "use_bias_correction_kl": ((True, False), NO_REFERENCE),
    "loss_type": (
        ("dapo",),
        "tandem's loss is the mean over the trained tokens of each micro-batch, all ranks "
        "together, averaged over gradient_accumulation_steps (TRL's 'dapo')",
    ),
    "scale_rewards": (("group", True), "advantages are (reward - group mean) / group std, always (TRL's 'group')"),
    "multi_objective_aggregation": (
        ("sum_then_normalize",),
        "reward functions are summed, then normalized within the group",
    ),
    "reward_weights": ((None,), "reward functions are summed with weight 1: scale a function's scores inside it"),
    "num_iterations": ((1,), "each batch is trained once; the next one is already on the rollout queue"),
    "vllm_importance_sampling_correction": (
        (True,),
        "the loss always weights tokens by the sampler's log-probs, "
        "masking those outside [vllm_importance_sampling_clip_min, _max]",
    ),
    "vllm_importance_sampling_cap": (
        (None,),
        "the ratio's bounds are vllm_importance_sampling_clip_min and _max; the truncate modes cap at _max",
    ),
    "off_policy_mask_threshold": (
        (None,),
        "off-policy tokens are masked by vllm_importance_sampling_clip_min / _max; "
        "max_staleness bounds how old a sample may be",
    ),
    "delta": (
        (None,),
        "the ratio is clipped by epsilon / epsilon_high and masked outside "
        "[vllm_importance_sampling_clip_min, _max]; a further upper clip is not implemented",
    ),
    "sapo_temperature_neg": ((1.05,), "read only by TRL's loss_type 'sapo', which tandem does not have"),
    "sapo_temperature_pos": ((1.0,), "read only by TRL's loss_type 'sapo', which tandem does not have"),
    "vespo_k_pos": ((2.0,), "read only by TRL's loss_type 'vespo', which tandem does not have"),
    "vespo_lambda_pos": ((3.0,), "read only by TRL's loss_type 'vespo', which tandem does not have"),
    "vespo_k_neg": ((3.0,), "read only by TRL's loss_type 'vespo', which tandem does not have"),
    "vespo_lambda_neg": ((2.0,), "read only by TRL's loss_type 'vespo', which tandem does not have"),
    "mask_truncated_completions": (
        (False,),
        "a completion cut at max_completion_length trains with its reward; masking it is not implemented",
    ),
    "top_entropy_quantile": (
        (1.0,),
        "GRPO trains every completion token (FlashREINFORCE keeps a failed trajectory's "
        "highest-entropy tokens: flash_negative_token_fraction)",
    ),
    "entropy_coef": ((0.0,), NO_ENTROPY),
    "use_adaptive_entropy": ((False,), NO_ENTROPY),
    "entropy_coef_min": ((0.0,), NO_ENTROPY),
    "entropy_coef_max": ((1.0,), NO_ENTROPY),
    "entropy_coef_delta": ((0.005,), NO_ENTROPY),
    "entropy_target": ((0.2,), NO_ENTROPY),
    # the model and the data
    "model_revision": ((None, "main"), "download the revision (hf download --revision) and give its folder as model"),
    "attn_implementation": (
        (None,),
        "tandem sets the attention itself: packed rows need its tree mask (tree_attention_kernel picks the kernel)",
    ),
    "cast_lm_head_to_fp32": (
        (False,),
        "the log-prob head computes in chunks in the weights' dtype; an fp32 head is "
        "not implemented (train in dtype float32)",
    ),
    "disable_dropout": (
        (False,),
        "set the model's dropout rates to 0 with model_init_kwargs (tandem warns when the model's config drops units)",
    ),
    "load_in_8bit": ((False,), NO_QUANTIZED),
    "load_in_4bit": ((False,), NO_QUANTIZED),
    "bnb_4bit_quant_type": (("nf4",), NO_QUANTIZED),
    "use_bnb_nested_quant": ((False,), NO_QUANTIZED),
    "bnb_4bit_quant_storage": ((None,), NO_QUANTIZED),
    "shuffle_dataset": (
        (True,),
        "the prompts are drawn in a new order each epoch (write train_sampling_strategy: "
        "sequential to keep the dataset's order)",
    ),
    "pad_to_multiple_of": (("auto", None), "samples are packed into rows of token_budget tokens, never padded"),
    "ignore_bias_buffers": ((False,), "tandem trains across processes with FSDP2, not DDP"),
    "reward_model_name_or_path": ((None,), "a reward model is not loaded: call one from a reward function"),
    # logging
    "log_multimodal": ((True,), "completions are logged as text (log_completions)"),
    "log_unique_prompts": ((False,), "log_completions logs each group's prompt once"),
    "log_completions_hub_repo": ((None,), "completions go to output_dir and the report_to trackers"),
}
"""TRL's fields with nothing to do in tandem: (the values that describe what tandem does, why it is not read)."""

REWARDS = {"accuracy_reward": "tandem.rewards.accuracy_reward"}
"""TRL's built-in reward functions, by the short names its recipes use, that tandem has too."""
KNOWN = {*RENAMED, *LORA, "use_peft", *NO_USE}
"""Every TRL key this module reads."""


def from_trl(raw: dict) -> tuple[dict, list[str]]:
    """`raw` recipe keys in tandem's terms, and one note per TRL key read; a TRL key set to something tandem cannot do
    raises UsageError saying why."""
    raw, notes = dict(raw), []
    test_split_given = "dataset_test_split" in raw
    for trl, ours in RENAMED.items():
        if trl in raw:
            if ours in raw:
                raise UsageError(
                    f"the recipe has both {trl!r} (TRL's name) and {ours!r}, two names for the same thing: keep one"
                )
            raw[ours] = raw.pop(trl)
            notes.append(f"{trl}: read as {ours} (tandem's name)")
    if test_split_given and "eval_dataset" not in raw and "dataset" in raw and raw.get("eval_strategy", "no") != "no":
        raw["eval_dataset"] = raw["dataset"]  # TRL's script evaluates the test split of the training dataset
        notes.append(f"eval_dataset: {raw['dataset']} (its {raw['eval_split']} split), as TRL's script evaluates")
    notes += _gather_lora(raw)
    for name in [key for key in raw if key in NO_USE]:
        accepted, why = NO_USE[name]
        value = raw.pop(name)
        if not any(same(value, ok) for ok in accepted):
            raise UsageError(f"{name}={value!r} (a TRL field) cannot act in tandem: {why}")
        notes.append(f"{name}: not read here; {why}")
    if "reward_funcs" in raw:
        raw["reward_funcs"], renamed = _reward_paths(raw["reward_funcs"])
        notes += [f"reward_funcs: {name} read as {REWARDS[name]}" for name in renamed]
    return raw, notes


def overridden(flag: str) -> set[str]:
    """The recipe keys a command-line flag replaces: its own, the other name of the same thing, and the other way of
    saying what to train (tandem's `lora` mapping, or TRL's use_peft)."""
    ours = RENAMED.get(flag, flag)
    names = {ours} | {trl for trl, tandem in RENAMED.items() if tandem == ours}
    if ours == "lora":
        names |= {"use_peft", *LORA}
    if flag == "use_peft":
        names.add("lora")
    return names


def same(value, accepted) -> bool:
    """`value` is `accepted`, a boolean or None only as itself (YAML's `1` is not `true`)."""
    if accepted is None or isinstance(accepted, bool) or value is None or isinstance(value, bool):
        return value is accepted
    return value == accepted


def _gather_lora(raw: dict) -> list[str]:
    """TRL's `use_peft` and `lora_*` keys folded into `raw['lora']`, with TRL's defaults for the keys not given."""
    given = {key: raw.pop(key) for key in list(raw) if key in LORA}
    use_peft = raw.pop("use_peft", None)
    if use_peft is None and not given:
        return []
    if not isinstance(use_peft, bool | None):
        raise UsageError(f"use_peft={use_peft!r}: expected true or false")
    if not use_peft and not given:
        return ["use_peft: false, read as training the whole model (tandem's default)"]
    if not use_peft:
        raise UsageError(
            f"{', '.join(given)}: TRL's LoRA keys act only with use_peft: true. Write use_peft: true to "
            "train an adapter, or leave them out to train the whole model."
        )
    if "lora" in raw:
        raise UsageError("the recipe has both TRL's use_peft/lora_* keys and tandem's lora mapping: keep one")
    raw["lora"] = {**LORA_DEFAULTS, **{LORA[key]: value for key, value in given.items() if value is not None}}
    return [f"use_peft{''.join(', ' + key for key in given)}: read as lora: {raw['lora']}"]


def _reward_paths(funcs) -> tuple[list[str] | str, list[str]]:
    """TRL's short reward names as tandem's import paths (a name tandem lacks is left for the importer to refuse)."""
    names = [funcs] if isinstance(funcs, str) else list(funcs) if isinstance(funcs, list) else None
    if names is None:
        return funcs, []
    renamed = [name for name in names if name in REWARDS]
    return [REWARDS.get(name, name) for name in names], renamed
