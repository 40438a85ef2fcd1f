"""train(trial=...) as a hyperparameter search calls it: a dict of config fields, set for that run."""

import pytest

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer, UsageError
from tandem.packing import pack
from tandem.rewards import accuracy_reward
from tandem.testing import scripted
from tests.packing.samples import sample
from tests.trainer.test_trainer import small_dataset


class Trainer(AsyncGRPOTrainer):
    runtime_cls = scripted([[[pack([sample([5, 6, 7, 8])])]]])  # one step of one row


def trainer(tmp_path, **fields) -> Trainer:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), save_strategy="no", score_centering=False, **fields)
    return Trainer("tiny", accuracy_reward, train_dataset=small_dataset(), args=args)


def test_a_trials_fields_reach_the_optimizer_the_sampling_temperature_and_the_loss(tmp_path):
    run = trainer(tmp_path, learning_rate=1e-3)
    output = run.train(trial={"learning_rate": 3e-5, "temperature": 0.7, "epsilon": 0.1, "max_steps": 1})
    assert output.global_step == 1
    assert run.args.learning_rate == 3e-5 and run.optimizer.param_groups[0]["initial_lr"] == 3e-5
    assert run.callbacks.handler.optimizer is run.optimizer, "callbacks see the optimizer the trial built"
    assert run.passes.temperature == 0.7, "the trainer's log-probs at the trial's temperature, as the sampler's"
    assert run.objective.rule.epsilon_low == run.objective.rule.epsilon_high == 0.1, "epsilon_high: epsilon's"
    assert run.runtime.logged, "the trial's runtime ran the step"
    again = run.train(trial={"learning_rate": 1e-5, "max_steps": 1})
    assert again.global_step == 1 and run.runtime.logged, "a second trial starts its counters from nothing"


def test_a_flash_reinforce_trial_keeps_its_config_valid(tmp_path):
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), save_strategy="no", algorithm="flash_reinforce", num_generations=1, max_steps=1
    )
    rollout = sample([5, 6, 7, 8])
    rollout.reward = 1.0  # FlashREINFORCE centres the rewards of the batch

    class FlashTrainer(AsyncGRPOTrainer):
        runtime_cls = scripted([[[pack([rollout])]]])

    run = FlashTrainer("tiny", accuracy_reward, train_dataset=small_dataset(), args=args)
    assert run.train(trial={"flash_delta": 0.01}).global_step == 1
    assert run.objective.delta == 0.01


def test_a_trial_is_checked_like_any_config_and_names_what_it_cannot_change(tmp_path):
    run = trainer(tmp_path)
    with pytest.raises(
        UsageError, match=r"'learning_rat' is not an AsyncGRPOConfig field \(did you mean 'learning_rate'"
    ):
        run.train(trial={"learning_rat": 1e-4})
    with pytest.raises(UsageError, match="dtype is read while the trainer is built.*args=AsyncGRPOConfig"):
        run.train(trial={"dtype": "bfloat16"})
    with pytest.raises(UsageError, match=r"AsyncGRPOConfig.temperature=5.0: must be in \(0, 2\]"):
        run.train(trial={"temperature": 5.0})
    with pytest.raises(NotImplementedError, match="an Optuna or Ray trial object"):
        run.train(trial=object())
