"""The reward functions of examples/own_task (docs/your-own-task.md walks through them).

tandem calls each function once per group: the `num_generations` completions of one prompt. It passes the
completions (each a list of messages), the prompts, the completions' token ids and every dataset column but
`prompt`, by name, one entry per completion. A function returns one float, or None, per completion, in order.
"""

import re

NUMBER = re.compile(r"-?\d+")


def completion_text(completion: list[dict]) -> str:
    """The text the model wrote: its assistant messages joined."""
    return "".join(message["content"] or "" for message in completion if message["role"] == "assistant")


def exact_match(completions, answer, **kwargs) -> list[float]:
    """1.0 when the reply is exactly the `answer` column (an int in data.jsonl), else 0.0. A sync function: tandem
    runs it in a thread."""
    return [1.0 if completion_text(c).strip() == str(a) else 0.0 for c, a in zip(completions, answer)]


async def close_answer(completions, answer, **kwargs) -> list[float | None]:
    """Partial credit: 0.5 for a wrong number within 2 of the answer, 0.0 for any other number (the right one
    included: exact_match pays for it). None for a reply with no number at all: this function does not judge it.
    An async function: tandem awaits it. Make a reward async when it waits on I/O (a judge model over HTTP);
    this one computes locally, to show the form."""
    scores = []
    for completion, expected in zip(completions, answer):
        found = NUMBER.search(completion_text(completion))
        if found is None:
            scores.append(None)
        else:
            scores.append(0.5 if 0 < abs(int(found.group()) - int(expected)) <= 2 else 0.0)
    return scores


if __name__ == "__main__":  # python examples/own_task/rewards.py: one made-up group, scored as tandem would call it
    import asyncio

    replies = ["137", "136", "13", "I don't know"]
    group = {
        "prompts": [[{"role": "user", "content": "What is 66 + 71?"}]] * len(replies),
        "completions": [[{"role": "assistant", "content": reply}] for reply in replies],
        "completion_ids": [[] for _ in replies],  # the token ids; unused here
        "answer": [137] * len(replies),  # a dataset column: the row's value, once per completion
    }
    print("exact_match  ", exact_match(**group))
    print("close_answer ", asyncio.run(close_answer(**group)))
