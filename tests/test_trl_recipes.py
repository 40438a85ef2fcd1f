"""A recipe written for TRL's GRPO script, run with `tandem train`: TRL's names are read with a note, a TRL field that
cannot act is refused saying why, and `--config` is TRL's spelling of the recipe argument."""

import importlib.util
import re

import pytest

from tandem import trl_names
from tandem.cli import main
from tandem.config import AsyncGRPOConfig
from tandem.recipe import RECIPE_KEYS, _field_types, load_recipe

# The fields of TRL 1.16.0's GRPOConfig (beyond transformers' TrainingArguments), ModelConfig, ScriptArguments and
# GRPOScriptArguments, as its dataclasses declare them (benchmarks run against that release: the `bench` extra).
TRL_FIELDS = """
learning_rate model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout cast_lm_head_to_fp32
remove_unused_columns num_generations num_generations_eval max_completion_length ds3_gather_for_generation
shuffle_dataset pad_to_multiple_of generation_batch_size steps_per_generation temperature top_p top_k min_p
generation_kwargs chat_template_kwargs repetition_penalty cache_implementation use_vllm vllm_mode vllm_model_impl
vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url vllm_server_host vllm_server_port
vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length vllm_tensor_parallel_size beta
num_iterations epsilon delta epsilon_high sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos
vespo_k_neg vespo_lambda_neg importance_sampling_level reward_weights multi_objective_aggregation scale_rewards
loss_type mask_truncated_completions sync_ref_model ref_model_mixup_alpha ref_model_sync_steps top_entropy_quantile
entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target
max_tool_calling_iterations vllm_importance_sampling_correction vllm_importance_sampling_mode
vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min off_policy_mask_threshold use_bias_correction_kl
log_completions log_multimodal num_completions_to_print log_unique_prompts log_completions_hub_repo
use_transformers_continuous_batching transformers_continuous_batching_config use_transformers_paged
vllm_importance_sampling_cap
model_name_or_path model_revision dtype attn_implementation use_peft lora_r lora_alpha lora_dropout lora_target_modules
lora_target_parameters lora_modules_to_save lora_task_type use_rslora use_dora load_in_8bit load_in_4bit
bnb_4bit_quant_type use_bnb_nested_quant bnb_4bit_quant_storage
dataset_name dataset_config dataset_train_split dataset_test_split dataset_streaming ignore_bias_buffers
reward_model_name_or_path reward_funcs
""".split()

# A recipe as TRL's GRPO docs write one, for the tiny model and the built-in arithmetic task.
TRL_RECIPE = """\
model_name_or_path: tiny
dataset_name: arithmetic-small
reward_funcs: [accuracy_reward]
use_vllm: true
vllm_mode: server
beta: 0.0
loss_type: dapo
use_peft: true
lora_r: 8
lora_target_modules: [q_proj, v_proj]
learning_rate: 1.0e-5
max_steps: 10
"""


def test_every_trl_grpo_key_is_a_tandem_field_or_is_read_or_refused_by_the_trl_tables():
    tandem_keys = set(_field_types()) | set(RECIPE_KEYS)
    unhandled = [name for name in TRL_FIELDS if name not in tandem_keys and name not in trl_names.KNOWN]
    assert not unhandled, f"TRL keys a recipe would get 'unknown key' for: {unhandled}"
    assert not set(trl_names.KNOWN) & set(_field_types()), "a key is both a tandem field and a TRL-only key"
    if importlib.util.find_spec("trl"):  # with the bench extra installed, the list above is TRL's own
        import dataclasses

        from transformers import TrainingArguments
        from trl import GRPOConfig, ModelConfig

        own = {f.name for f in dataclasses.fields(GRPOConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
        assert own | {f.name for f in dataclasses.fields(ModelConfig)} <= set(TRL_FIELDS) | {"learning_rate"}


def test_a_trl_recipe_runs_with_one_note_per_trl_key(tmp_path, capsys):
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(TRL_RECIPE)
    main(["train", "--config", str(recipe), "--dry-run"])
    out, err = capsys.readouterr()
    notes = [line.split(": note: ", 1)[1] for line in err.splitlines()]
    assert notes == [
        "model_name_or_path: read as model (tandem's name)",
        "dataset_name: read as dataset (tandem's name)",
        "use_peft, lora_r, lora_target_modules: read as lora: {'r': 8, 'lora_alpha': 32, 'lora_dropout': 0.05, "
        "'task_type': 'CAUSAL_LM', 'target_modules': ['q_proj', 'v_proj']}",
        "use_vllm: not read here; generation runs on a server: the embedded tandem serve, or the one at "
        "vllm_server_base_url, always",
        "vllm_mode: not read here; generation runs on a server: the embedded tandem serve, or the one at "
        "vllm_server_base_url; there is no engine colocated in the trainer's process",
        "beta: not read here; tandem's objective has no KL penalty to a reference model, so none is loaded",
        "loss_type: not read here; tandem's loss is the mean over the trained tokens of each micro-batch, all ranks "
        "together, averaged over gradient_accumulation_steps (TRL's 'dapo')",
        "reward_funcs: accuracy_reward read as tandem.rewards.accuracy_reward",
    ], err
    assert out.startswith("model: tiny\ndataset: arithmetic-small\nreward_funcs:\n- tandem.rewards.accuracy_reward\n")
    recipe_read = load_recipe(str(recipe))
    assert recipe_read.lora["target_modules"] == ["q_proj", "v_proj"] and recipe_read.config.learning_rate == 1e-5


@pytest.mark.parametrize(
    "line, reason",
    [
        ("beta: 0.04", r"beta=0.04 \(a TRL field\) cannot act in tandem: tandem's objective has no KL penalty"),
        ("use_vllm: false", r"use_vllm=False \(a TRL field\) cannot act in tandem: generation runs on a server"),
        ("vllm_mode: colocate", "vllm_mode='colocate' .* there is no engine colocated in the trainer's process"),
        ("vllm_gpu_memory_utilization: 0.9", "start vllm serve with --gpu-memory-utilization"),
        ("scale_rewards: batch", r"advantages are \(reward - group mean\) / group std, always"),
        ("shuffle_dataset: false", "write train_sampling_strategy: sequential"),
        ("lora_r: 8", "lora_r: TRL's LoRA keys act only with use_peft: true"),
    ],
)
def test_a_trl_field_that_cannot_act_is_refused_in_one_line_saying_why(line, reason, tmp_path, capsys):
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(f"model: tiny\n{line}\n")
    with pytest.raises(SystemExit) as stop:
        main(["train", str(recipe), "--dry-run"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert re.search(reason, err), err


def test_a_key_neither_trainer_has_gets_its_nearest_names_and_the_reference_not_every_key(tmp_path, capsys):
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text("model: tiny\nlora_rank: 8\nfrobnicate: 1\n")
    with pytest.raises(SystemExit) as stop:
        main(["train", str(recipe), "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err) < 400, err  # a line, not the 160 keys there are
    assert "'frobnicate'; 'lora_rank' (did you mean 'local_rank' or 'lora_r' or 'lora_alpha'?)" in err, err
    assert "docs/references/config.md" in err, "where every key is described"
    assert "learning_rate" not in err, "the whole list of keys"


def test_config_is_trls_spelling_of_the_recipe_argument(capsys):
    main(["train", "--config", "examples/demo.yaml", "--dry-run"])
    assert "max_steps: 300" in capsys.readouterr().out
    for argv in (["train"], ["train", "demo", "--config", "examples/demo.yaml"]):
        with pytest.raises(SystemExit) as stop:
            main([*argv, "--dry-run"])
        assert stop.value.code == 2 and "give one recipe" in capsys.readouterr().err


def test_trl_server_host_and_port_name_the_server_to_generate_from(capsys, tmp_path):
    assert AsyncGRPOConfig(vllm_server_host="10.0.0.5").vllm_server_base_url == "http://10.0.0.5:8000"
    assert AsyncGRPOConfig(vllm_server_port=8001).vllm_server_base_url == "http://0.0.0.0:8001"
    with pytest.raises(ValueError, match="name two servers: keep one"):
        AsyncGRPOConfig(vllm_server_host="10.0.0.5", vllm_server_base_url="http://10.0.0.6:8000")
    with pytest.raises(ValueError, match="vllm_server_port=70000: must be a port number"):
        AsyncGRPOConfig(vllm_server_port=70000)
    with pytest.raises(SystemExit) as stop:  # the run generates from there, where nothing answers
        main(
            [
                "train",
                "demo",
                "--vllm_server_host",
                "127.0.0.1",
                "--vllm_server_port",
                "9",
                "--vllm_server_timeout",
                "2",
                "--output_dir",
                str(tmp_path / "run"),
            ]
        )
    assert stop.value.code == 2 and "http://127.0.0.1:9/health did not answer" in capsys.readouterr().err


def test_trls_test_split_is_evaluated_on_the_training_dataset_when_eval_is_on(tmp_path):
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text("model: tiny\ndataset_name: org/data\ndataset_test_split: validation\n")
    assert load_recipe(str(recipe)).eval_dataset is None, "TRL evaluates only with an eval_strategy"
    read = load_recipe(str(recipe), ["--eval_strategy", "steps", "--eval_steps", "10"])
    assert (read.eval_dataset, read.eval_split) == ("org/data", "validation")


def test_a_flag_replaces_the_recipes_value_whichever_name_either_uses(tmp_path):
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text("model_name_or_path: tiny\nlora: {r: 4}\n")
    read = load_recipe(str(recipe), ["--model", "/models/other", "--use_peft", "true"])
    assert read.model == "/models/other" and read.lora["r"] == 16, "the flags win over the file's other names"
    assert load_recipe("demo", ["--model_name_or_path", "/models/other"]).model == "/models/other"
    assert load_recipe("demo", ["--vllm_gpu_memory_utilization", "3e-1"]).config is not None, "read as TRL's 0.3"


def test_what_trl_writes_out_at_its_defaults_is_read(tmp_path):
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(
        "model: tiny\nuse_peft: false\nuse_bias_correction_kl: false\n"
        "vllm_server_base_url: http://10.0.0.6:8000\nvllm_server_host: 0.0.0.0\nvllm_server_port: 8000\n"
    )
    read = load_recipe(str(recipe))
    assert read.lora is None and read.config.vllm_server_base_url == "http://10.0.0.6:8000"
    assert "use_peft: false, read as training the whole model (tandem's default)" in read.notes
