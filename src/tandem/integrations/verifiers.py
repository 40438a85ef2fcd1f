"""verifiers environments (prime-rl's `verifiers.v1`: `Env`, tasksets, harnesses, rewards) trained by tandem: pass an
environment (`vf.load_environment(config)`, or its config) as `train_dataset` / `eval_dataset`.

Its tasks become rows (each task's prompt, for tandem's length checks, and where to find the task); in the worker,
`VerifiersRolloutLoop` plays each rollout as one verifiers episode (`env.run_episode`), the environment's harness
owning the conversation and its tools. Every model call goes to tandem: verifiers' training client renders the
prompt to token ids and posts them to `/inference/v1/generate` on a loopback endpoint of the worker (`Capture`), which
samples through the loop's `generate_one_turn` (the sampler's ids and log-probs, the rollout's seeds and policy version)
and keeps each turn, so the turns reconcile into samples by the same extend-or-fork rule as tandem's own tools. The
episode's reward (the weighted sum of its rewards) is the source `verifiers_reward`, each of its rewards logged as
`rewards/<name>/mean`.

Not supported (NotImplementedError, when the trainer is built): runtimes other than the local subprocess one
(Prime sandboxes, Docker, ...), harnesses that need a container, LLM judges, environments of several agents, and
endless tasksets. Offline, the harness `tandem_harness` (verifiers_harness.py: an in-process chat loop over the
task's MCP tools) needs nothing from the network, where verifiers' own `bash` / `null` install uv from PyPI first.
"""

import hashlib
import pickle
import sys
from dataclasses import dataclass

from tandem.errors import UsageError
from tandem.integrations import extras

PREFIX = "verifiers:"
ENVIRONMENT, TASK = "verifiers_environment", "verifiers_task"
"""The columns a row carries: its environment's key (in CONFIGS) and the index of its task in the environment's
taskset."""
RECIPE_AGENT = {"harness": {"id": "tandem_harness"}, "runtime": {"type": "subprocess"}}
"""A recipe's agent unless its dataset_options say otherwise: tandem's harness, run locally (verifiers' defaults are
the uv-installed `bash` harness and a Prime sandbox)."""


def library():
    return extras.library("verifiers.v1", "verifiers environments need the verifiers package", "verifiers")


def is_environment(value) -> bool:
    """A verifiers.v1 environment or environment config (only when verifiers is imported: no import for others)."""
    vf = sys.modules.get("verifiers.v1")
    return vf is not None and isinstance(value, (vf.Env, vf.EnvConfig))


@dataclass
class VerifiersHarness:
    """What the worker needs to play the rows' episodes: the run's environment configs, by their rows' key."""

    configs: dict[str, object]

    @property
    def loop_cls(self) -> type:
        from tandem.integrations.verifiers_loop import VerifiersRolloutLoop  # the worker's side, imported when run

        return VerifiersRolloutLoop


def load(name: str, options: dict | None = None):
    """The rows of `verifiers:<taskset id>` in a recipe: a single-agent environment of that taskset, its `dataset_options`
    the SingleAgentEnvConfig's other fields (the agent: tandem's harness, run locally, unless they say otherwise)."""
    vf, options = library(), dict(options or {})
    options["agent"] = {**RECIPE_AGENT, **options.get("agent", {})}
    try:
        config = vf.SingleAgentEnvConfig(taskset={"id": name.removeprefix(PREFIX)}, **options)
    except (ValueError, ModuleNotFoundError, TypeError) as exc:
        raise UsageError(
            f"dataset {name!r} with dataset_options {options}: verifiers refused it: {str(exc).splitlines()[0]}"
        ) from None
    return rows_of(config)


def adapt(train_dataset, eval_dataset, reward_funcs):
    """Verifiers environments as rows, and the harness that plays the rows of any (else None); the rest unchanged."""
    train = rows_of(train_dataset) if is_environment(train_dataset) else train_dataset
    evaluate = rows_of(eval_dataset) if is_environment(eval_dataset) else eval_dataset
    keys = {key for rows in (train, evaluate) if ENVIRONMENT in columns_of(rows) for key in rows[ENVIRONMENT]}
    if not keys:
        return train, evaluate, reward_funcs, None
    if ENVIRONMENT not in columns_of(train) or (evaluate is not None and ENVIRONMENT not in columns_of(evaluate)):
        raise UsageError(
            "a verifiers environment plays every rollout of the run: pass one (its tasks, or another "
            "environment's) as train_dataset and as eval_dataset alike, not beside a plain dataset"
        )
    unknown = sorted(keys - set(CONFIGS))
    if unknown:
        raise UsageError(
            "these rows name a verifiers environment this process never loaded (rows saved and read "
            "back?): pass the environment itself, or its recipe's dataset: verifiers:<taskset id>"
        )
    return train, evaluate, reward_funcs, VerifiersHarness({key: CONFIGS[key] for key in keys})


def columns_of(rows) -> list[str]:
    return list(getattr(rows, "column_names", None) or [])


CONFIGS: dict[str, object] = {}
"""The environment configs whose tasks this process made rows of, by the key the rows carry (a config's hash: a
config per row would cost its ~2 KB pickle on every task)."""


def rows_of(environment):
    """An environment's tasks as rows: each task's prompt as messages (tandem's length checks), its environment's key
    and its index there."""
    from datasets import Dataset

    vf = library()
    config = environment if isinstance(environment, vf.EnvConfig) else environment.config
    check_config(config)
    env = vf.load_environment(config) if isinstance(environment, vf.EnvConfig) else environment
    if getattr(env.taskset, "INFINITE", False):
        raise NotImplementedError(
            f"the taskset {config.taskset.id!r} is endless (INFINITE): tandem trains on tasksets "
            "whose tasks can be listed"
        )
    key = hashlib.sha256(pickle.dumps(config)).hexdigest()[:16]
    CONFIGS[key] = config
    rows = [{"prompt": prompt_of(task.data), ENVIRONMENT: key, TASK: number} for number, task in enumerate(env.taskset)]
    if not rows:
        raise UsageError(f"the verifiers taskset {config.taskset.id!r} has no tasks")
    return Dataset.from_list(rows)


def prompt_of(data) -> list[dict]:
    """A task's prompt as chat messages (its system prompt first)."""
    prompt = data.prompt
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(prompt, str):
        return messages + [{"role": "user", "content": prompt}]
    return messages + [
        {"role": m.role, "content": m.content if isinstance(m.content, str) else str(m.content)} for m in prompt
    ]


def check_config(config) -> None:
    """What tandem cannot run, refused when the trainer is built, each naming the fix where there is one."""
    vf = library()
    agents = {
        name: getattr(config, name)
        for name in type(config).model_fields
        if isinstance(getattr(config, name), vf.AgentConfig)
    }
    if len(agents) != 1:
        raise NotImplementedError(
            f"the verifiers environment {config.taskset.id!r} has {len(agents)} agents "
            f"({', '.join(agents)}): tandem trains environments of one agent"
        )
    [(name, agent)] = agents.items()
    if not isinstance(agent.runtime, vf.SubprocessConfig):
        raise NotImplementedError(
            f"the agent {name!r} runs in a {type(agent.runtime).__name__} runtime; tandem runs "
            "episodes in its rollout worker: set runtime=vf.SubprocessConfig() in its AgentConfig"
        )
    harness = vf.load_harness(agent.harness or vf.default_agent_harness(config.taskset.id))
    if harness.NEEDS_CONTAINER:
        raise NotImplementedError(
            f"the harness {harness.config.id!r} needs a container; use one that runs locally, "
            "e.g. harness={'id': 'tandem_harness'}"
        )
    if config.taskset.task.judges:
        raise NotImplementedError(
            "LLM judges (taskset.task.judges) call a model over the network; score with "
            "@vf.reward functions, or a reward function of the trainer"
        )
