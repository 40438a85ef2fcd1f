"""`AsyncRolloutLoop`: generates and scores rollouts in the worker process.

For each prompt, in dataset order from `dataset_start_index`: `filter_prompt`, then `num_generations`
rollouts (`generate_one`: the multi-turn tool loop, which calls `generate_one_turn` per sampling request;
with environments, each rollout's instance is reset first and scores it after), then the group is
scored (reward functions + environment / rollout rewards, summed), `compute_advantages` runs, groups
without reward variance are dropped, and the rest become samples on the trainer's queue. Subclass it
and override the hooks; set the subclass as the trainer's `loop_cls`.

This class is the hooks and the helpers they use, nothing else: the scheduling (allowance, concurrency, retries,
scoring, evaluation, failures) is a `RolloutScheduler` (rollout/scheduler.py) that a subclass never sees.
"""

import numpy as np

from tandem.chat.tool_calls import ToolCall, parse_reply
from tandem.chat.tool_formats import tool_call_format
from tandem.contract.channels import Channels
from tandem.contract.records import Rollout, RolloutGroup, TurnRecord
from tandem.rollout import scoring
from tandem.rollout.generation import GROUP_SEED, ROW
from tandem.rollout.scheduler import RolloutScheduler
from tandem.rollout.settings import RolloutSettings
from tandem.rollout.tools import Toolbox


class AsyncRolloutLoop:
    """The hooks, in the order each prompt meets them: `filter_prompt`, `generate_one` (per rollout), which calls
    `generate_one_turn` (per sampling request), then `compute_advantages` (per group); `setup` and `close` around the
    whole run. A hook may read `config` (an AsyncGRPOConfig, a subclass's own fields included), `tokenizer`,
    `base_url` and `api_key` (the generation server, for a client of its own made in `setup`) and `settings`."""

    rollout_reward_name = "rollout_reward"
    """The reward source `Rollout.reward` is summed and logged as (rewards/{name}/mean)."""

    def __init__(self, settings: RolloutSettings, *, processing_class, channels: Channels):
        self.settings = settings
        self.config = settings.config
        self.tokenizer = processing_class
        self.tool_format = (
            None
            if self.config.tool_call_parser is None
            else tool_call_format(self.config.tool_call_parser, processing_class)
        )
        """The format replies' tool calls are read in (the run's tool_call_parser; None: Hermes or response_template)."""
        self.base_url, self.api_key = settings.base_url, settings.api_key
        self._scheduler = RolloutScheduler(
            self, settings, processing_class, channels, whole_groups=samples_whole_groups(type(self))
        )

    async def run(self) -> None:
        """Generate and score until the prompts run out or the trainer says stop (the worker process calls this)."""
        await self._scheduler.run()

    # ---- hooks ------------------------------------------------------------------------------------
    def filter_prompt(self, row_index: int, row: dict, epoch: int) -> bool:
        """Whether to generate for this prompt (default: all). Rejected prompts count as consumed."""
        return True

    async def setup(self) -> None:
        """Create resources the other hooks need (runs on the loop's event loop before the first prompt)."""

    async def close(self) -> None:
        """Release what setup() created (runs when the loop ends, failures included)."""

    async def generate_one(self, prompt: list[dict], tools: list, group_id: int = 0) -> Rollout:
        """One rollout, the multi-turn tool loop: each turn renders the whole conversation, samples a reply and runs
        its tool calls in the order written. It ends on a reply without calls, at `max_tool_calling_iterations`
        (the rollout is trained all the same), or when the next prompt would leave no room in `max_model_len`."""
        generation, toolbox = self._scheduler.generation, self.toolbox(tools)
        rollout = Rollout(completion=[], completion_ids=[], turns=[])
        cap, exhausted = self.config.max_tool_calling_iterations, False
        while True:
            prompt_ids = self.render(list(prompt) + rollout.completion, toolbox.schemas)
            if not generation.room_after(prompt_ids) and not rollout.turns:
                raise ValueError(
                    f"a rollout's first prompt renders to {len(prompt_ids)} tokens (the tools' schemas "
                    f"included), leaving no room to generate in max_model_len={generation.max_model_len}: "
                    "shorten the prompt or the text reset() adds, offer fewer tools, or start the server "
                    "with a larger --max-model-len"
                )
            if not generation.room_after(prompt_ids):
                self.record("rollout/context_exhausted_count", 1)
                break
            turn = await self.generate_one_turn(prompt_ids)
            rollout.turns.append(turn)
            rollout.completion_ids += turn.output_ids
            message, calls = self.reply(turn.output_ids, parse=bool(tools))
            rollout.completion.append(message)
            if not calls:
                break
            if cap is not None and len(rollout.turns) > cap:
                exhausted = True
                break
            self.record("tools/parallel_calls_mean", len(calls))
            for call in calls:  # in order: they may share an environment's state
                result = await generation.runner.call(toolbox, call)
                generation.record_call(result)
                rollout.tool_call_count += 1
                rollout.tool_failure_count += result.failed
                rollout.completion.append({"role": "tool", "name": result.name, "content": result.content})
        if tools:
            self.record("tools/call_frequency", rollout.tool_call_count)
            self.record("tools/loop_exhausted_frac", float(exhausted))
        return rollout

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One request to the server with the config's sampling settings."""
        [turn] = await self._scheduler.generation.sample(prompt_ids, n=1)
        return turn

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout: rewards standardised within the group (unscored rollouts get 0)."""
        assert group.rewards is not None  # advantages follow scoring
        return scoring.group_advantages(group.rewards)

    # ---- helpers for the hooks ----------------------------------------------------------------------
    def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation (with the tools' schemas) and the generation prompt; renderings are cached,
        so a group's rollouts share the first one."""
        return self._scheduler.generation.render(messages, tools)

    def reply(self, output_ids: list[int], parse: bool) -> tuple[dict, list[ToolCall]]:
        """A sampled reply as an assistant message, and its tool calls. With tools they are parsed out of the text
        (their markers may be special tokens, so those are kept in decoding); without, the text is the reply."""
        ids = list(output_ids)
        while ids and ids[-1] in self.settings.eos_token_ids:
            ids.pop()
        if not parse:
            return {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}, []
        parsed = parse_reply(
            self.tokenizer.decode(ids, skip_special_tokens=False), self.tokenizer, tool_format=self.tool_format
        )
        return parsed.message(), parsed.tool_calls

    def toolbox(self, tools: list) -> Toolbox:
        """The rollout's tools by name with their schemas (made once per function, whatever instance it is bound to)."""
        return self._scheduler.generation.toolbox(tools)

    def record(self, name: str, *values) -> None:
        """Add values of metric `name` to the trainer's next log (reduced by the name's window rule)."""
        self._scheduler.record(name, *values)

    def row(self) -> dict:
        """The dataset row of the rollout being generated (the hooks get its prompt; this gives its other columns)."""
        return ROW.get()

    def group_seed(self) -> int:
        """A seed of the group being generated, the same for its rollouts (a task an environment draws from it is the
        group's) and again when the group is generated anew; from the run's `seed` and the prompt's index."""
        return GROUP_SEED.get()


def samples_whole_groups(loop_cls: type[AsyncRolloutLoop]) -> bool:
    """Whether a single-turn group may be one request with n = num_generations (one prefill and one HTTP round trip
    instead of G): only when `generate_one` and `generate_one_turn` are the defaults, since an override is called per
    rollout and per request, as TRL documents it. (Tools and environments keep one call per rollout too: the scheduler
    knows those.)"""
    return (
        loop_cls.generate_one is AsyncRolloutLoop.generate_one
        and loop_cls.generate_one_turn is AsyncRolloutLoop.generate_one_turn
    )
