"""`HarnessAsyncGRPOTrainer`: AsyncGRPOTrainer over OpenEnv harness episodes (an agent trained on its own harness).
Each rollout is one episode of a session from `harness_session_factory`, driven by `harness_adapter` in the rollout
worker, every model call sampled by tandem (integrations/openenv.py)."""

from tandem.config import AsyncGRPOConfig
from tandem.integrations import openenv
from tandem.trainer.trainer import AsyncGRPOTrainer

DEFAULT_MAX_TURNS = 10
"""Turns of an episode when max_tool_calling_iterations is None (OpenEnv's HarnessRunLimits default)."""


class HarnessAsyncGRPOTrainer(AsyncGRPOTrainer):
    def __init__(
        self,
        model,
        harness_session_factory,
        harness_adapter=None,
        reward_funcs=None,
        args: AsyncGRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        eval_dataset=None,
    ):
        """As AsyncGRPOTrainer, with the rollouts played by OpenEnv: `harness_session_factory`, a
        `ResourceSessionFactory` (or a picklable callable returning one), makes each episode's session with
        `create(task=<the row's prompt>, seed=<the group>, episode_id=...)`; `harness_adapter`, a white-box
        `HarnessAdapter` such as `MCPHarnessAdapter()`, runs it for at most max_tool_calling_iterations + 1 turns.
        The environment's reward is the source `harness_reward`; `reward_funcs` add to it. Without a train_dataset
        the sessions make their own tasks (max_steps sets the run's length)."""
        args = args or AsyncGRPOConfig()
        openenv.check_harness(harness_session_factory, harness_adapter)
        cap = args.max_tool_calling_iterations
        self.harness = openenv.OpenEnvHarness(
            harness_session_factory, harness_adapter, max_turns=DEFAULT_MAX_TURNS if cap is None else cap + 1
        )
        super().__init__(
            model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            eval_dataset=eval_dataset,
        )
