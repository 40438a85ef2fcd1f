"""Training a verifiers.v1 environment: the taskset of examples/arithmetic_taskset (arithmetic, a calculator tool over
MCP, a reward in Python), played by tandem's in-process harness, every model call sampled by tandem.

    pip install 'tandem-rl[verifiers]' && python examples/verifiers_arithmetic.py     (about 6 minutes on 2 CPU cores)

The environment is verifiers' own object (`vf.load_environment`); tandem takes it as the train_dataset. Its episodes
run in the rollout worker, the calculator in one MCP server process for the whole run. Nothing needs the network.
Pretrained, the tiny model calls the calculator on part of the problems; RL teaches it to, and to answer with the
result.
"""

import verifiers.v1 as vf

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer


def environment():
    """The verifiers environment: the taskset by its plugin id, one agent with tandem's harness, run locally."""
    return vf.load_environment(
        vf.SingleAgentEnvConfig(
            taskset={"id": "arithmetic_taskset"},
            agent=vf.AgentConfig(harness={"id": "tandem_harness"}, runtime=vf.SubprocessConfig(), max_turns=3),
        )
    )


def config(**overrides) -> AsyncGRPOConfig:
    values = dict(
        output_dir="runs/verifiers_arithmetic",
        max_steps=100,
        learning_rate=2e-4,
        num_generations=8,
        max_completion_length=32,
        max_staleness=2,
        token_budget=1024,
        gradient_checkpointing=False,
        save_steps=1000,
        logging_steps=1,
    )
    return AsyncGRPOConfig(**{**values, **overrides})


if __name__ == "__main__":
    trainer = AsyncGRPOTrainer(model="tiny", args=config(), train_dataset=environment())
    output = trainer.train()
    head, tail = trainer.reward_history[:20], trainer.reward_history[-20:]
    print(
        f"\ntrained {output.global_step} steps; mean reward, first {len(head)} steps: {sum(head) / len(head):.3f}   "
        f"last {len(tail)} steps: {sum(tail) / len(tail):.3f}"
    )
