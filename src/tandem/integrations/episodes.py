"""What the loops that play other libraries' episodes share: how a failed episode is counted, and where a finished
conversation's completion starts."""

import sys
import traceback

FAILED_IN_A_ROW = 20
"""Episodes failing in a row (every rollout of several groups) before the worker stops the run with the last error."""


class EpisodeFailures:
    """Episodes that raised: each is counted (env/failure_count) and said in a line, and FAILED_IN_A_ROW in a row stop
    the run with the last one's error: an environment that always fails must not spin the worker forever."""

    def __init__(self, library: str, record):
        self.library, self.record, self.in_a_row = library, record, 0

    def failed(self, error: BaseException | str) -> None:
        self.record("env/failure_count", 1)
        self.in_a_row += 1
        text = error if isinstance(error, str) else "".join(traceback.format_exception(error)).rstrip()
        if self.in_a_row >= FAILED_IN_A_ROW:
            raise RuntimeError(f"{FAILED_IN_A_ROW} {self.library} episodes in a row failed; the last one:\n{text}")
        last = text.splitlines()[-1] if text else "no error given"
        print(f"tandem: a {self.library} episode failed and is left out of its group: {last}", file=sys.stderr)

    def succeeded(self) -> None:
        self.in_a_row = 0


def completion_of(messages: list[dict]) -> list[dict]:
    """A conversation's messages from the first reply on: what the rollout added to its prompt."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return messages[first:]
