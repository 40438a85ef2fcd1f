"""Everything the rollout loop is built from, in one picklable object: the trainer fills it in, the worker
process receives it, the loop reads it."""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tandem.config import AsyncGRPOConfig
from tandem.contract.agents import EnvironmentFactories, Harness
from tandem.dataset_rows import Rows
from tandem.generation.server_facts import ServerFacts


@dataclass
class RolloutSettings:
    config: AsyncGRPOConfig
    model_name: str
    """The name requests are sent under (the server's served model name)."""
    tokenizer_path: str
    dataset: Rows | None
    reward_funcs: list
    eos_token_ids: list[int]
    base_url: str
    api_key: str | None = None
    tools: list | None = None
    environment_factory: EnvironmentFactories | None = None
    harness: Harness | None = None
    """Another library's episodes (an OpenEnv harness, a verifiers environment), which its loop class runs."""
    dataset_start_index: int = 0
    """The first prompt index to generate for (a resumed run's watermark)."""
    received: frozenset[int] = frozenset()
    """Prompt indices past `dataset_start_index` the trainer already holds (a resumed run, a restarted worker): not generated."""
    queued_tokens: float = 0.0
    """Tokens of the samples the trainer holds untrained: on the queue, as far as the allowance is concerned."""
    full_step_tokens: float = 0.0
    """The tokens one step consumes when every row is full: the allowance before the trainer's first step."""
    num_prompts: int | None = None
    """Where the prompt stream ends (epochs × rows), or None for an endless stream (max_steps decides)."""
    eval_dataset: Iterable[Mapping[str, Any]] | None = None
    """Prompts the trainer has evaluated (generated and scored, never trained) when it asks on `Channels.evaluate`."""
    server: ServerFacts | None = None
    """What the server said about itself when the trainer connected (None: the worker asks it when it needs to)."""
    adapter_name: str | None = None
    """LoRA training: requests name the adapter version current when their group started, e.g. 'tandem-policy-v{version}'."""

    @property
    def max_model_len(self) -> int | None:
        """The server's context length, as the trainer read it at connect: a conversation ends before its prompt passes
        it (None: not known)."""
        return self.server.max_model_len if self.server else None
