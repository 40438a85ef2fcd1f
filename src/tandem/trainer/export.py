"""A checkpoint as one model folder that `vllm serve`, transformers and `tandem serve` load without peft
(`tandem export`): a LoRA checkpoint's adapter merged into its base model by peft's `merge_and_unload`, a
full-weight checkpoint's model alone; each with the tokenizer, and none of the training state (optimizer, schedule,
prompt stream). A torchrun checkpoint exports the same way: its model folder was saved whole (checkpoint.py), and
its sharded `distributed/` folder is not read.
"""

import json
import shutil
from pathlib import Path

from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from tandem.errors import UsageError
from tandem.model.distributed import Ranks
from tandem.model.model_folder import save_model_folder
from tandem.tasks import TINY_MODEL_PATH
from tandem.trainer import checkpoint

ADAPTER_CONFIG = "adapter_config.json"


def default_output(checkpoint_dir: Path) -> Path:
    """`RUN_DIR/checkpoint-N` exports to `RUN_DIR/checkpoint-N-merged` (which `checkpoint-N` patterns do not match)."""
    return checkpoint_dir.parent / f"{checkpoint_dir.name}-merged"


def export(
    checkpoint_dir: Path,
    output: Path | None = None,
    *,
    base_model: str | None = None,
    dtype: str = "auto",
    force: bool = False,
) -> Path:
    """Write checkpoint `checkpoint_dir` as one model folder at `output` (written beside it first, then renamed);
    returns the folder. `base_model` overrides the one the checkpoint records; `force` replaces a non-empty `output`."""
    check_checkpoint(checkpoint_dir)
    output = output or default_output(checkpoint_dir)
    check_output(output, checkpoint_dir, force)
    if (checkpoint_dir / ADAPTER_CONFIG).is_file():
        model = merge_adapter(checkpoint_dir, base_model or recorded_base_model(checkpoint_dir), dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype)
    staging = output.with_name(f".{output.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    write(model, AutoTokenizer.from_pretrained(checkpoint_dir), staging)
    shutil.rmtree(output, ignore_errors=True)  # empty, or replaced with force
    staging.rename(output)
    return output


def check_checkpoint(path: Path) -> None:
    """A `checkpoint-N` folder a run wrote, with a model in it; else the error says what was given and what to give."""
    if not (path / "trainer_state.json").is_file():
        found = checkpoint.checkpoints(path) if path.is_dir() else []
        hint = f" (this looks like a run folder: did you mean {found[-1]}?)" if found else ""
        raise FileNotFoundError(
            f"{path} is not a tandem checkpoint (no trainer_state.json){hint}. Give a RUN_DIR/checkpoint-N folder."
        )
    if not (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} holds neither a model (config.json) nor a LoRA adapter ({ADAPTER_CONFIG}): "
            "it is not a complete checkpoint. Export another checkpoint-N of the run."
        )


def check_output(output: Path, checkpoint_dir: Path, force: bool) -> None:
    """`output` may be new, empty, or (with `force`) replaced, but never the checkpoint or a folder holding it."""
    if output.resolve() == checkpoint_dir.resolve() or output.resolve() in checkpoint_dir.resolve().parents:
        raise UsageError(
            f"--output {output} would replace the checkpoint {checkpoint_dir} itself. Choose another folder."
        )
    if output.is_file():
        raise FileExistsError(f"--output {output} is a file. Choose a folder.")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise FileExistsError(
            f"--output {output} exists and is not empty. Choose another folder, or pass --force to replace it."
        )


def recorded_base_model(checkpoint_dir: Path) -> str:
    """The base model a LoRA checkpoint's adapter merges into: the one its trainer_state.json records ("tiny" is the
    shipped model), else the adapter's own `base_model_name_or_path` (checkpoints written before tandem recorded it)."""
    state = json.loads((checkpoint_dir / "trainer_state.json").read_text())
    adapter = json.loads((checkpoint_dir / ADAPTER_CONFIG).read_text())
    name = state.get("base_model") or adapter.get("base_model_name_or_path")
    if not name:
        raise UsageError(
            f"{checkpoint_dir} records no base model for its adapter (the run's model was built in "
            "memory). Name its folder or hub id: tandem export --base-model PATH."
        )
    return name


def merge_adapter(adapter_dir: Path, base_model: str, dtype: str) -> PreTrainedModel:
    """A fresh copy of `base_model` (loaded on the CPU, in `dtype`) with the LoRA adapter saved in `adapter_dir`
    merged into its weights: a plain transformers model."""
    base_model = TINY_MODEL_PATH if base_model == "tiny" else base_model
    try:
        base = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype)
    except OSError as exc:  # a folder moved away, a hub id not in the cache offline
        missing = Path(base_model).is_absolute() and not Path(base_model).exists()  # else transformers reads a hub id
        reason = "no such folder" if missing else (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(
            f"cannot load the base model {base_model!r} that the adapter in {adapter_dir} merges into "
            f"({reason}). Name its folder or hub id (tandem export --base-model PATH; "
            "AsyncGRPOTrainer(model=PATH))."
        ) from None
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()


def write(model: PreTrainedModel, tokenizer, folder: Path) -> None:
    """`model` and `tokenizer` as one folder transformers loads (config, generation config, safetensors, tokenizer)."""
    save_model_folder(model, folder, Ranks())
    tokenizer.save_pretrained(folder)
