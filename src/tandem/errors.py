"""How a user is told what went wrong: `UsageError` (a mistake in what the user gave, told apart from a bug),
`install_command` (the fix for a missing extra) and, on the command line, warnings as one line each."""

import os
import sys
import warnings

from tandem import DISTRIBUTION

COMMAND_VARIABLE = "TANDEM_COMMAND"
"""Set by the command line to the command running (train, serve, ...), so that the processes it starts (the rollout
worker) show their warnings as it does."""


class UsageError(ValueError):
    """A setting, recipe, dataset, tool or model the run cannot use, with the value and the fix in its message:
    `tandem train` prints it in one line and exits 2, while any other exception keeps its traceback (a bug). A
    ValueError, so code that catches those still does."""


def install_command(extra: str) -> str:
    """The command that installs one of tandem's extras (`pip install 'tandem-rl[vllm]'`)."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


def warnings_as_lines(command: str) -> None:
    """Show every warning of this process, and of the processes it starts, as one `tandem <command>: warning: ...` line
    on stderr, without the source line Python adds (which reads like a crash). The Python API keeps Python's format."""
    os.environ[COMMAND_VARIABLE] = command

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"tandem {command}: warning: {' '.join(str(message).split())}", file=file or sys.stderr)

    warnings.showwarning = show
