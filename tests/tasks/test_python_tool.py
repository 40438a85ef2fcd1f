"""The Python tool runs the model's programs apart: its own interpreter and folder, limits, no network."""

import subprocess

import pytest

from tandem.rollout.tools import validate_tools
from tandem.tasks import python_tool
from tandem.tasks.python_tool import python


def test_a_program_prints_its_answer_and_a_failing_one_says_its_error():
    validate_tools([python])  # a tool the model can call: type hints and a docstring
    assert python("print(sum(range(10)))") == "45\n"
    assert python("1 / 0") == "error: ZeroDivisionError: division by zero"
    assert python("x = 1") == "(the program printed nothing)"
    assert python("print('a' * 10_000)").count("characters left out") == 1, "a long output is shortened"


def test_a_program_gets_no_network_no_more_memory_and_no_more_time_than_allowed(monkeypatch):
    assert (
        python("import socket; socket.create_connection(('127.0.0.1', 80))")
        == "error: OSError: the network is disabled for this program"
    )
    if python_tool.isolation():  # the child's own network namespace: even the raw socket module reaches nothing
        assert python("import _socket; print(_socket.socket().connect_ex(('127.0.0.1', 9)))") != "0\n"
    assert python("x = bytearray(4 << 30)") == "error: MemoryError"
    assert python("import os; print(os.listdir('.'), os.environ.get('HOME'))") == "[] None\n", (
        "an empty folder, no environment"
    )
    monkeypatch.setattr(python_tool, "TIMEOUT_S", 1.0)
    assert python("while True: pass") == "error: the program ran longer than 1 s and was stopped"


def test_without_network_namespaces_the_sockets_are_still_disabled_and_it_is_said(monkeypatch):
    python_tool.isolation.cache_clear()
    monkeypatch.setattr(python_tool.shutil, "which", lambda name: None)
    try:
        with pytest.warns(UserWarning, match="programs run with Python's sockets disabled"):
            assert (
                python("import socket; socket.socket()") == "error: OSError: the network is disabled for this program"
            )
    finally:
        python_tool.isolation.cache_clear()


def test_a_program_sees_no_other_process_and_what_it_starts_dies_with_it():
    if not python_tool.isolation():
        pytest.skip("this system lets no user make process namespaces: the process group is killed instead")
    assert python("import os; print(sorted(p for p in os.listdir('/proc') if p.isdigit()))") == "['1']\n", (
        "its own process namespace: the trainer's environment is not readable through /proc"
    )
    assert python("import ssl, asyncio, urllib.request; print('ok')") == "ok\n", "modules that subclass socket import"
    python("import subprocess; subprocess.Popen(['sleep', '31.25'])")  # left running by the program
    left = subprocess.run(["pgrep", "-f", "sleep 31.25"], capture_output=True, text=True).stdout.split()
    assert left == [], "what a program starts ends with it"
