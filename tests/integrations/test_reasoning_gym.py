"""reasoning-gym's procedural tasks train unchanged: a recipe's `reasoning-gym:<task>`, or its dataset object, with
each task scored by its own scorer on the answer a completion gives."""

import json

import pytest
import reasoning_gym
from reasoning_gym.composite import DatasetSpec

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer, UsageError
from tandem.integrations.reasoning_gym import ENTRY, TASK, TaskScore, extract_answer, rewards_for
from tandem.tasks import datasets

SMALL = {"size": 16, "seed": 3, "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def reply(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    "text, answer",
    [
        ("Let me think. <answer> 42 </answer>", "42"),
        ("3 + 4 = 7, so the answer is 7.", "7"),
        ("First 2 * 3 = 6.\nSo 6", "6"),
        ("", None),
        ("<answer>1</answer> then <answer>2</answer>", "2"),
    ],
)
def test_the_answer_is_taken_from_a_tag_a_statement_or_the_last_line(text, answer):
    assert extract_answer(text) == answer


def test_a_recipes_task_is_generated_and_scored_by_its_own_scorer_on_the_extracted_answer():
    rows = datasets.load("reasoning-gym:basic_arithmetic", options=SMALL)
    assert len(rows) == 16 and rows[0]["prompt"][0]["role"] == "user" and set(rows[TASK]) == {"basic_arithmetic"}
    answers = [reasoning_gym.create_dataset("basic_arithmetic", **SMALL)[i]["answer"] for i in range(2)]
    [score] = rewards_for(rows)
    assert score.__name__ == "basic_arithmetic", "logged as rewards/basic_arithmetic/mean"
    wrong = str(int(answers[1]) + 1)  # a wrong answer that does not contain the right one
    completions = [reply(f"So the answer is {answers[0]}."), reply(f"It is not {answers[1]}, it is {wrong}")]
    assert score(completions, **{TASK: rows[TASK][:2], ENTRY: rows[ENTRY][:2]}) == [1.0, 0.0], (
        "the answer the completion gives, not partial credit for mentioning it"
    )
    with pytest.raises(UsageError, match="reasoning-gym:no_such_task.*reasoning-gym refused it"):
        datasets.load("reasoning-gym:no_such_task")


def test_a_composite_of_weighted_tasks_scores_each_row_by_its_own_task():
    specs = [
        DatasetSpec(name="basic_arithmetic", weight=3, config={}),
        DatasetSpec(name="chain_sum", weight=1, config={}),
    ]
    rows = datasets.load("reasoning-gym:composite", options={"size": 40, "seed": 1, "datasets": specs})
    scores = rewards_for(rows)
    assert {s.task for s in scores} == {"basic_arithmetic", "chain_sum"}
    for score in scores:
        got = score([reply("0")] * 40, **{TASK: rows[TASK], ENTRY: rows[ENTRY]})
        assert [g is None for g in got] == [task != score.task for task in rows[TASK]], "None: another task's row"


@pytest.mark.long  # its scoring and rows are tested above, in the default suite
def test_a_reasoning_gym_dataset_object_trains_with_its_tasks_rewards_through_the_worker(tmp_path):
    train = reasoning_gym.create_dataset("basic_arithmetic", **SMALL)
    held_out = reasoning_gym.create_dataset("basic_arithmetic", **{**SMALL, "size": 4, "seed": 99})
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        num_generations=4,
        max_completion_length=8,
        gradient_checkpointing=False,
        save_strategy="no",
        eval_strategy="steps",
        eval_steps=2,
    )
    trainer = AsyncGRPOTrainer("tiny", args=args, train_dataset=train, eval_dataset=held_out)
    assert [type(f) for f in trainer.reward_funcs] == [TaskScore], "no reward_funcs: the tasks' own scorers"
    trainer.train()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert any("rewards/basic_arithmetic/mean" in r for r in rows)
    assert any("eval/rewards/basic_arithmetic/mean" in r for r in rows), "the eval rows are scored the same way"
