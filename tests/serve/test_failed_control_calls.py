"""A control call that fails leaves `tandem serve` as it was: a refused adapter or checkpoint changes no weight, and
every request after it, to the base model and to the adapters already loaded, is served. Against a real process."""

import json
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tandem.serve import lora
from tandem.tasks import TINY_MODEL_PATH
from tests.conftest import ServeProcess
from tests.serve.test_lora_and_reload import make_adapter

PROMPT = [1, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(root / "good", seed=1)
    s = ServeProcess(
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--logprobs-mode", "processed_logprobs"
    )
    assert s.post("/v1/load_lora_adapter", {"lora_name": "good", "lora_path": str(root / "good")})[0] == 200
    s.root = root
    yield s
    s.close()


def served(serve, model=None) -> list[float]:
    """A seeded completion's log-probs: what the weights behind `model` compute."""
    body = {"prompt": PROMPT, "max_tokens": 4, "logprobs": 0, "seed": 3, "temperature": 1.0} | (
        {"model": model} if model else {}
    )
    status, answer = serve.post("/v1/completions", body)
    assert status == 200, f"after the failed call, a request to {model or 'the base model'} got {status}: {answer}"
    return answer["choices"][0]["logprobs"]["token_logprobs"]


def adapter_folder(root, name: str, edit) -> str:
    """A copy of the good adapter changed by `edit(folder)`."""
    folder = root / name
    shutil.copytree(root / "good", folder)
    edit(folder)
    return str(folder)


def edit_config(**changes):
    def edit(folder):
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps(config | changes))

    return edit


def reshaped_tensor(folder):
    path = folder / "adapter_model.safetensors"
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = torch.zeros(4, 3)
    save_file(tensors, str(path))


def truncated_tensors(folder):
    path = folder / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def unknown_layer(folder):
    path = folder / "adapter_model.safetensors"
    save_file({"base_model.model.model.layers.0.mlp.not_a_layer.lora_A.weight": torch.zeros(4, 8)}, str(path))


REFUSALS = {
    "modules_to_save lm_head": (
        edit_config(modules_to_save=["lm_head"]),
        500,
        "Unsupported modules_to_save: ['lm_head']",
    ),
    "rank above --max-lora-rank": (edit_config(r=16), 500, "LoRA rank 16 is greater than max_lora_rank 8."),
    "DoRA": (edit_config(use_dora=True), 500, "vLLM does not yet support DoRA."),
    "a tensor of the wrong shape": (reshaped_tensor, 500, "has shape (4, 3)"),
    "a cut-off tensor file": (truncated_tensors, 500, "is not readable"),
    "a layer the model lacks": (unknown_layer, 500, "Please verify that the loaded LoRA module is correct"),
    "no tensors": (lambda f: (f / "adapter_model.safetensors").unlink(), 500, "doesn't contain tensors"),
    "config not JSON": (lambda f: (f / "adapter_config.json").write_text("{r: 4"), 500, "not readable JSON"),
    "no adapter_config.json": (lambda f: (f / "adapter_config.json").unlink(), 404, "No adapter found for"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_adapter_load_answers_as_vllm_and_changes_nothing(serve, case):
    edit, status, message = REFUSALS[case]
    base, good = served(serve), served(serve, "good")
    path = adapter_folder(serve.root, case.replace(" ", "_"), edit)
    answer_status, answer = serve.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
    assert answer_status == status and message in answer["error"]["message"], answer
    if status == 500:
        assert answer["error"]["message"].startswith("Call to add_lora method failed: ")
    assert serve.get("/health")[0] == 200
    assert served(serve) == base and served(serve, "good") == good, "a failed load changed the weights served"
    status, answer = serve.post("/v1/completions", {"prompt": PROMPT, "model": "bad"})
    assert status == 404, "a failed load registers no name"


def test_a_failed_in_place_reload_keeps_serving_the_adapters_old_weights(serve):
    good = served(serve, "good")
    path = adapter_folder(serve.root, "good_v2_broken", edit_config(modules_to_save=["lm_head"]))
    status, _ = serve.post("/v1/load_lora_adapter", {"lora_name": "good", "lora_path": path, "load_inplace": True})
    assert status == 500
    assert served(serve, "good") == good


def test_a_reload_refused_by_its_second_file_copies_none_of_the_first(serve, tmp_path):
    base = served(serve)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    state = {k: (v + 0.5).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "a.safetensors"))  # fits the model: read first
    save_file({"model.norm.weight": torch.zeros(3)}, str(tmp_path / "b.safetensors"))  # the wrong shape
    status, answer = serve.post(
        "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
    )
    assert status == 400 and "'model.norm.weight' has shape (3,)" in answer["error"]["message"], answer
    assert served(serve) == base, "the refused checkpoint's first file was copied in"


@pytest.mark.parametrize("wrapped", [False, True], ids=["first adapter", "beside another"])
def test_a_load_that_fails_inside_peft_is_undone(tmp_path, monkeypatch, wrapped):
    """Past every check, PEFT can still fail half-way (a disk error while reading): its layers are taken out again."""
    make_adapter(tmp_path / "one", seed=1)
    make_adapter(tmp_path / "two", seed=2)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32).eval()
    if wrapped:
        model = lora.load_into(model, str(tmp_path / "one"), "lora1")
    before = {name: type(module) for name, module in model.named_modules()}

    def failing_read(*args, **kwargs):
        raise OSError("the disk failed mid-read")

    monkeypatch.setattr("peft.peft_model.load_peft_weights", failing_read)
    with pytest.raises(OSError, match="mid-read"):
        lora.load_into(model, str(tmp_path / "two"), "lora2")
    assert {name: type(module) for name, module in model.named_modules()} == before, "PEFT's layers were left in"
    if wrapped:
        assert isinstance(model, PeftModel) and set(model.peft_config) == {"lora1"}
        assert not any("lora2" in getattr(m, "lora_A", {}) for m in model.modules()), "lora2's matrices were left in"
    else:
        assert not hasattr(model, "peft_config"), "PEFT's config was left on the model"
