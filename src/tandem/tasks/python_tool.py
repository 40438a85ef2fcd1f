"""A sandboxed Python tool (for FlashREINFORCE's multi-turn tool use): the model writes a program, the tool runs it
and answers with what it printed.

It runs code nobody reviewed, so every call runs in a fresh interpreter of its own (`python -I`: no user site, no
environment variables) in an empty temporary folder, with its address space, CPU time, file sizes and wall time
limited, in process and network namespaces of its own where the system lets users make them (`unshare`: no network;
it sees only its own processes, so not the trainer's environment through /proc; everything it started dies with
it), else with Python's sockets disabled in the child and its process group killed after, which a determined
program could get around (said once). Files outside its folder are not hidden from it: run the worker as a user
that may write nothing else when the data is untrusted.
"""

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings

TIMEOUT_S = 10.0
"""Wall time of one program."""
MEMORY_BYTES = 1 << 30
"""Address space of one program (numpy's import alone maps a few hundred MB)."""
FILE_BYTES = 16 << 20
"""Largest file a program may write (in its temporary folder, removed after)."""
OUTPUT_CHARS = 4000
"""What the model reads back at most: the start and the end of a longer output."""

CHILD = f"""\
import resource, socket, sys
for limit, value in ((resource.RLIMIT_AS, {MEMORY_BYTES}), (resource.RLIMIT_CPU, {int(TIMEOUT_S) + 1}),
                     (resource.RLIMIT_FSIZE, {FILE_BYTES}), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
class _NoNetwork(socket.socket):  # a class still, so that modules which subclass it (ssl, asyncio) import
    def __init__(self, *args, **kwargs):
        raise OSError("the network is disabled for this program")
def _no_network(*args, **kwargs):
    raise OSError("the network is disabled for this program")
socket.socket, socket.create_connection, socket.getaddrinfo = _NoNetwork, _no_network, _no_network
code = sys.stdin.read()
sys.stdin = open("/dev/null")
del resource, socket, sys, limit, value, _NoNetwork, _no_network
exec(compile(code, "<program>", "exec"), {{"__name__": "__main__"}})
"""
"""What the child runs first: its own limits (set there, not with preexec_fn, which is unsafe in the tool threads),
sockets disabled, then the program read from stdin (no size limit of an argument)."""


def python(code: str) -> str:
    """Run a Python program and return what it prints.

    Args:
        code: A complete Python program; print() the values you want to see.

    Returns:
        The program's output (stdout, then stderr); the last line of the error when it fails.
    """
    with tempfile.TemporaryDirectory(prefix="tandem-python-") as folder:
        process = subprocess.Popen(
            [*isolation(), sys.executable, "-I", "-c", CHILD],
            cwd=folder,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,
        )
        try:
            stdout, stderr = process.communicate(code, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stdout = None
        finally:  # whatever it started goes with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        if stdout is None:
            return f"error: the program ran longer than {TIMEOUT_S:g} s and was stopped"
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    output = done.stdout + (done.stderr if done.returncode == 0 else error_of(done.stderr, done.returncode))
    return shortened(output) if output.strip() else "(the program printed nothing)"


def error_of(stderr: str, returncode: int) -> str:
    """A failed program's error, as the model needs it: the exception's line (a traceback's last), or the signal."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if lines:
        return f"error: {lines[-1].strip()}"
    if returncode < 0:  # killed by a signal: the CPU limit's SIGXCPU, or SIGKILL past the memory limit
        return f"error: the program was stopped by signal {-returncode} (a time or memory limit)"
    return f"error: the program exited with status {returncode}"


def shortened(text: str) -> str:
    if len(text) <= OUTPUT_CHARS:
        return text
    half = OUTPUT_CHARS // 2
    return f"{text[:half]}\n... ({len(text) - OUTPUT_CHARS} characters left out) ...\n{text[-half:]}"


@functools.cache
def isolation() -> tuple[str, ...]:
    """`unshare` into network and process namespaces of the child's own, where this system lets a user make them
    (checked once), else nothing, said once: the child's disabled sockets are then the only barrier."""
    command = ("unshare", "--net", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child")
    if shutil.which("unshare"):
        try:
            if subprocess.run([*command, "true"], capture_output=True, timeout=10).returncode == 0:
                return command
        except (OSError, subprocess.TimeoutExpired):
            pass
    warnings.warn(
        "python tool: this system does not let users make network and process namespaces (unshare), so "
        "programs run with Python's sockets disabled, which a program could undo",
        stacklevel=3,
    )
    return ()
