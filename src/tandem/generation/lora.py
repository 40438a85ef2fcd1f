"""LoRA adapters served by name, as vLLM does: several live at once, mixed in one batch.

Names are registered by `/v1/load_lora_adapter`; their weights are loaded into one PEFT model
on demand and evicted least-recently-used beyond `max_cpu_loras` (reloaded from their path on the
next use). At most `max_loras` distinct adapters run in one batch; the engine defers the rest.
"""

import collections
import json
from pathlib import Path

import torch
from peft import PeftModel

BASE = "__base__"
"""PEFT's name for "no adapter" in a mixed batch."""


class AdapterNotFound(LookupError):
    pass


class AdapterSet:
    def __init__(self, max_loras: int = 1, max_lora_rank: int = 16, max_cpu_loras: int | None = None):
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.paths: dict[str, str] = {}
        self.int_ids: dict[str, int] = {}
        self.loaded: collections.OrderedDict[str, str] = collections.OrderedDict()  # name -> PEFT name, LRU order
        self._next_id = 1
        self._stale: list[str] = []

    def check(self, name: str, path: str) -> None:
        """Raise AdapterNotFound for a missing adapter and ValueError for a rank above max_lora_rank."""
        config_file = Path(path) / "adapter_config.json"
        if not config_file.is_file():
            raise AdapterNotFound(f"Loading lora {name} failed: No adapter found for {path}")
        rank = json.loads(config_file.read_text()).get("r", 0)
        if rank > self.max_lora_rank:
            raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.")

    def register(self, name: str, path: str) -> None:
        self.check(name, path)
        if name in self.loaded:  # re-registered under a new path: its old weights must not be served
            self._stale.append(self.loaded.pop(name))
        self.paths[name] = path
        self.int_ids[name] = self._next_id
        self._next_id += 1

    def unregister(self, name: str) -> None:
        """Forget the name (its weights stay cached until evicted, as in vLLM)."""
        del self.paths[name]

    def can_join(self, active: set[str], name: str) -> bool:
        return len(active | {name}) <= self.max_loras

    @property
    def active(self) -> bool:
        return bool(self.loaded)

    def ensure_loaded(self, model: torch.nn.Module, names: set[str], in_use: set[str]) -> torch.nn.Module:
        """Load every adapter in `names` into `model` (wrapping it in PEFT on first use); returns the model."""
        for name in sorted(names - set(self.loaded)):
            peft_name = f"lora{self.int_ids[name]}"
            if isinstance(model, PeftModel):
                model.load_adapter(self.paths[name], adapter_name=peft_name, is_trainable=False)
            else:
                model = PeftModel.from_pretrained(model, self.paths[name], adapter_name=peft_name, is_trainable=False)
            model.eval()
            self.loaded[name] = peft_name
            while len(self.loaded) > self.max_cpu_loras:
                victim = next((n for n in self.loaded if n not in in_use and n not in names), None)
                if victim is None:
                    break
                model.delete_adapter(self.loaded.pop(victim))
        # Weights replaced by a re-registration go once another adapter is loaded: PEFT needs one left to be active.
        while self._stale and isinstance(model, PeftModel) and len(model.peft_config) > 1:
            model.delete_adapter(self._stale.pop())
        for name in names:
            self.loaded.move_to_end(name)
        return model

    def names_for(self, adapters: list[str | None]) -> list[str]:
        """PEFT adapter names for a batch, one per row."""
        return [self.loaded[a] if a else BASE for a in adapters]
