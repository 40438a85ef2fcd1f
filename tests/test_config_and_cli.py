"""AsyncGRPOConfig validation and `tandem train` recipes, overrides and the dry run."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.config import AsyncGRPOConfig
from tandem.generation.launcher import EmbeddedServer
from tandem.recipe import load_recipe
from tandem.tasks import TINY_MODEL_PATH


def test_defaults_are_the_documented_ones():
    c = AsyncGRPOConfig()
    assert (c.num_generations, c.max_staleness, c.max_concurrent_rollouts, c.learning_rate, c.lr_scheduler_type) == (
        8,
        4,
        512,
        1e-6,
        "constant",
    )
    assert (c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max, c.num_sampler_logprobs) == (
        0.5,
        5.0,
        8,
    )
    assert c.epsilon == 0.2 and c.epsilon_high is None, "None: the upper bound is epsilon's (make_objective)"


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("temperature", 0.0, "temperature=0.0"),
        ("num_generations", 1, "at least 2 generations"),
        ("vllm_importance_sampling_clip_max", 0.5, "never be masked"),
        ("vllm_importance_sampling_mode", "sequence_clip", "must be one of token_mask, token_truncate"),
        ("importance_sampling_level", "sequence", "set score_centering=False"),
        ("algorithm", "ppo", "must be one of"),
        (
            "report_to",
            ["tensorboard", "tensorbord"],
            "report_to=.*must be one of all, none, tensorboard, trackio, wandb",
        ),
    ],
)
def test_bad_values_name_the_field_and_the_fix(field, value, message):
    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(**{field: value})


def test_a_decaying_schedule_needs_max_steps():
    with pytest.raises(ValueError, match="set max_steps"):
        AsyncGRPOConfig(lr_scheduler_type="cosine")


def test_unknown_fields_are_refused():
    with pytest.raises(TypeError):
        AsyncGRPOConfig(per_device_train_batch_sise=8)


def test_recipe_overrides_are_typed(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: tiny\nlearning_rate: 1e-5\nreward_funcs: tandem.rewards.accuracy_reward\n")
    r = load_recipe(str(recipe), ["--learning_rate", "3e-4", "--max-steps=7", "--report_to", "[tensorboard]"])
    assert r.config.learning_rate == 3e-4 and r.config.max_steps == 7 and r.config.report_to == ["tensorboard"]
    assert r.reward_funcs == ["tandem.rewards.accuracy_reward"] and r.dataset == "arithmetic"
    with pytest.raises(ValueError, match="unknown recipe key.*'lr'"):
        load_recipe(str(recipe), ["--lr", "1"])
    # YAML reads `no` as false; a field that takes words takes the word (TRL's recipes say `save_strategy: no`), saying so
    recipe.write_text("model: tiny\nsave_strategy: no\n")
    with pytest.warns(UserWarning, match="save_strategy: YAML reads the bare word as False; taken as 'no'"):
        assert load_recipe(str(recipe), ["--eval_strategy", "no"]).config.save_strategy == "no"


def test_a_string_field_on_the_command_line_takes_the_text_as_transformers_parser_does(tmp_path):
    config = load_recipe(
        "examples/demo.yaml", ["--save_strategy", "no", "--run_name", "on", "--output_dir=1.5", "--max_steps", "7"]
    ).config
    assert (config.save_strategy, config.run_name, config.output_dir, config.max_steps) == ("no", "on", "1.5", 7)
    assert load_recipe("examples/demo.yaml", ["--run_name", "null"]).config.run_name is None


def served_commands(out: str) -> dict[str, str]:
    """The dry run's two server commands, continuation lines joined: {"gpu": vllm serve ..., "cpu": vLLM's CPU build}."""
    joined = out.replace(" \\\n    ", " ").splitlines()  # a continuation line is indented by four spaces
    commands = [line for line in joined if line.startswith("VLLM_SERVER_DEV_MODE=1 ")]
    assert len(commands) == 2 and all("\\" not in c for c in commands), "two commands, every continuation line joined"
    return {
        "gpu": next(c for c in commands if " vllm serve " in c),
        "cpu": next(c for c in commands if "-m vllm." in c),
    }


def test_dry_run_prints_the_recipe_and_the_server_commands(capsys):
    main(["train", "examples/demo.yaml", "--dry-run", "--max_completion_length", "16"])
    out = capsys.readouterr().out
    assert "max_completion_length: 16" in out
    commands = served_commands(out)
    longest = int(out.split("# --max-model-len: the longest prompt (")[1].split(" tokens")[0])
    assert 10 < longest < 40, "the demo's arithmetic prompts render to about 20 tokens"
    for command in commands.values():
        assert "--logprobs-mode processed_logprobs" in command and f"--max-model-len {longest + 16}" in command
        assert "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1" in command, (
            "a dead engine answers so: the run stops at once, naming it"
        )
    assert '--weight-transfer-config \'{"backend": "nccl"}\'' in commands["gpu"], "GPUs: vLLM's own NCCL engine"
    assert '--weight-transfer-config \'{"backend": "gloo"}\'' in commands["cpu"], "CPUs: tandem's plugin"
    assert f"--max-num-batched-tokens {256 * (longest + 16)}" in commands["cpu"], (
        "no prefill is split on vLLM's CPU build (a seeded one would kill its engine)"
    )
    assert "pip install 'tandem-rl[vllm]' beside" in " ".join(out.replace("\n# ", " ").split()), (
        "the NCCL transfer needs vLLM's helpers"
    )


def test_a_lora_recipe_prints_the_adapter_flags_its_server_needs(capsys, tmp_path):
    main(["train", "examples/lora.yaml", "--dry-run", "--max_staleness", "3"])
    out = capsys.readouterr().out
    for command in served_commands(out).values():
        assert "--enable-lora --max-loras 5 --max-cpu-loras 5 --max-lora-rank 8" in command, "max_staleness + 2, rank 8"
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in command, "vLLM loads adapters at run time only when told so"
        assert "--api-server-count" not in command, "vLLM refuses several API servers with runtime adapter loads"
        assert "--weight-transfer-config" not in command, "the adapter travels by name, not the weights"
    assert "lora:\n  r: 8" in out
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model: tiny\nlora: {r: 4, rank_dropout: 0.1}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(recipe), "--dry-run"])
    err = capsys.readouterr().err
    assert (
        exit_info.value.code == 2
        and re.search("lora: .*rank_dropout.*LoraConfig fields", err)
        and "Traceback" not in err
    )


def test_flash_reinforce_dry_run_prints_settings_and_server_without_touching_cuda():
    code = (
        "import torch; from tandem.cli import main; main(['train', 'examples/flash_reinforce/cpu.yaml', '--dry-run']); "
        "print('cuda initialised:', torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert "algorithm: flash_reinforce" in out and "num_generations: 1" in out and "0.003 (flash_delta)" in out
    assert "vllm serve" in out and "cuda initialised: False" in out
    assert not Path("runs/flash_reinforce/cpu").exists(), "a dry run starts nothing and writes nothing"


def test_flash_reinforce_needs_one_generation_per_prompt():
    with pytest.raises(ValueError, match="num_generations=8.*set num_generations=1"):
        AsyncGRPOConfig(algorithm="flash_reinforce")
    with pytest.raises(ValueError, match="flash_delta=-1"):
        AsyncGRPOConfig(algorithm="flash_reinforce", num_generations=1, flash_delta=-1)


def test_the_toy_update_example_runs_one_step_on_cpu():
    out = subprocess.run(
        [sys.executable, "examples/toy_update.py"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "loss" in out and "acceptance rate  1.000" in out
    before, after = (float(x) for x in out.split("P(action 0)")[1].split("->"))
    assert after > before, "rewarded actions become more likely after one step"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--learnin_rate", "1e-4"],
            r"unknown recipe key 'learnin_rate' \(did you mean 'learning_rate'\?\)\. Every key is described in docs/references/config.md",
        ),
        (["--learning_rate", "abc"], r"AsyncGRPOConfig.learning_rate='abc': expected a number, got str.$"),
        (["--max_steps", "1.5"], r"AsyncGRPOConfig.max_steps=1.5: expected a whole number, got float.$"),
        (
            ["--gradient_checkpointing", "maybe"],
            r"AsyncGRPOConfig.gradient_checkpointing='maybe': expected true or false, got str.$",
        ),
        (
            ["--reward_funcs", "[tandem.rewards.accuracy_reward, 3]"],
            r"reward_funcs=.*: expected a string \(or a list of them\)$",
        ),
        (["--tools", "[tandem.tasks.arithmetic:calculatr]"], "cannot import 'tandem.tasks.arithmetic:calculatr'"),
    ],
)
def test_a_recipe_mistake_is_one_line_naming_the_field_the_value_and_the_type(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "examples/demo.yaml", *argv, "--dry-run"])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and len(error.splitlines()) == 1, error
    assert re.match(f"tandem train: examples/demo.yaml: {message}", error.strip()), error


def test_a_missing_recipe_names_the_path_it_looked_for(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "examples/missing.yaml"])
    assert stop.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"no such recipe file (looked for {Path('examples/missing.yaml').resolve()})")
    )


def test_the_python_api_refuses_a_value_of_the_wrong_type_by_name():
    with pytest.raises(ValueError, match=r"AsyncGRPOConfig.num_generations='8': expected a whole number, got str"):
        AsyncGRPOConfig(num_generations="8")
    assert AsyncGRPOConfig(learning_rate=1).learning_rate == 1, "a whole number is a number"
    with pytest.raises(ValueError, match="expected a number, got bool"):
        AsyncGRPOConfig(temperature=True)


def test_tandem_serve_refuses_a_bad_weight_transfer_config_in_one_line():
    for value, message in [("{backend: gloo}", "is not JSON"), ('{"backend": "nccl"}', "nccl is vllm serve's")]:
        done = subprocess.run(
            [sys.executable, "-m", "tandem", "serve", "tiny", "--weight-transfer-config", value],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_tandem_serve_tiny_answers_to_the_name_it_was_typed_with_and_to_its_folder():
    from openai import OpenAI

    with EmbeddedServer("tiny", shares_cores=False) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        assert [model.id for model in client.models.list()] == ["tiny", TINY_MODEL_PATH], (
            "listed as typed first, as vLLM"
        )
        for name in ("tiny", TINY_MODEL_PATH):  # the folder: the name a trainer pointed at this server asks for
            # seeded, EOS ignored: an unseeded draw ended at EOS first once (finish "stop", no text)
            completion = client.completions.create(
                model=name, prompt="What is 2 + 3?", max_tokens=2, seed=0, extra_body={"ignore_eos": True}
            )
            assert completion.model == name and completion.choices[0].text


def test_fsdp_config_takes_reshard_after_forward_and_refuses_the_rest():
    assert AsyncGRPOConfig(fsdp_config={"fsdp_reshard_after_forward": False}).fsdp_config == {
        "fsdp_reshard_after_forward": False
    }
    assert AsyncGRPOConfig(fsdp_config='{"reshard_after_forward": true}').fsdp_config == {"reshard_after_forward": True}
    with pytest.raises(ValueError, match=r"fsdp_config keys \['cpu_offload'\] are not supported"):
        AsyncGRPOConfig(fsdp_config={"cpu_offload": True})
    with pytest.raises(ValueError, match="expected true or false"):
        AsyncGRPOConfig(fsdp_config={"reshard_after_forward": "no"})


def test_the_api_key_is_read_from_the_environment_and_masked_in_logs(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sekret")
    config = AsyncGRPOConfig()
    assert config.vllm_server_api_key == "sekret" and config.to_dict()["vllm_server_api_key"] == "***"


def test_evaluation_asked_for_without_an_eval_dataset_is_one_line_not_a_traceback(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "examples/demo.yaml", "--eval_strategy", "steps", "--max_steps", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "needs an eval_dataset" in err and "Traceback" not in err


def test_a_bug_while_building_the_trainer_keeps_its_traceback_where_a_users_mistake_is_one_line(monkeypatch):
    import tandem
    import tandem.cli.train

    def broken(*args, **kwargs):
        raise ValueError("a bug of tandem's, not the recipe's")

    monkeypatch.setattr(tandem.cli.train, "build_trainer", broken)
    with pytest.raises(ValueError, match="a bug of tandem's"):  # not SystemExit(2): a bug is not the user's mistake
        main(["train", "examples/demo.yaml", "--max_steps", "2"])
    with pytest.raises(tandem.UsageError, match="max_staleness=-1"):  # what the CLI prints in one line, from Python
        tandem.AsyncGRPOConfig(max_staleness=-1)


def test_a_setting_the_server_cannot_serve_found_at_connect_is_one_line(monkeypatch, capsys):
    """in_flight_weight_updates meets the server only once the run connects to it (inside train()): what it refuses
    there ends the run in one line, as a recipe mistake does."""
    import tandem

    def connect_refuses(trainer, *args, **kwargs):
        raise NotImplementedError(
            "in_flight_weight_updates=True: the weights reach the server at URL by a folder reload"
        )

    monkeypatch.setattr(tandem.AsyncGRPOTrainer, "train", connect_refuses)
    with pytest.raises(SystemExit) as stop:
        main(["train", "examples/demo.yaml", "--in_flight_weight_updates", "true", "--max_steps", "2"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "in_flight_weight_updates=True: the weights reach" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--resume_from_checkpoint", "{tmp}"], "is not a tandem checkpoint .no rollout_state.json."),
        (["--dataset", "{tmp}/saved", "--dataset_split", "tset"], "has no split 'tset' .its splits: train, test."),
    ],
)
def test_a_mistake_met_while_building_or_starting_the_run_is_one_line(argv, message, tmp_path, capsys):
    from datasets import Dataset, DatasetDict

    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}])
    DatasetDict(train=rows, test=rows).save_to_disk(str(tmp_path / "saved"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "train",
                "examples/demo.yaml",
                "--output_dir",
                str(tmp_path / "run"),
                *[a.format(tmp=tmp_path) for a in argv],
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert re.search(message, err.strip().splitlines()[-1]), err  # after the model's loading bar, one line


def test_tandem_serve_refuses_a_tool_call_format_its_tokenizer_cannot_write_in_one_line():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem",
            "serve",
            "tiny",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "llama3_json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "'llama3_json' reads calls opened by <|python_tag|>, which this tokenizer has no token for" in lines[0]


def test_a_server_mistake_is_one_line_naming_what_to_check(capsys, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tandem", "serve", "/nonexistent/model"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "/nonexistent/model: no such model folder" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    with pytest.raises(SystemExit) as exit_info:  # a URL where no server answers
        main(
            [
                "train",
                "examples/demo.yaml",
                "--vllm_server_base_url",
                "http://127.0.0.1:9",
                "--vllm_server_timeout",
                "2",
                "--output_dir",
                str(tmp_path / "run"),
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "http://127.0.0.1:9/health did not answer 200 within 2s" in err, err
    assert "Is the generation server running and is the URL right?" in err.strip().splitlines()[-1]
