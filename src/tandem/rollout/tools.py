"""Running the tools a rollout calls.

A `Toolbox` is the set of tools one rollout sees, by `__name__`, with the JSON schemas the chat template
lists. `ToolRunner` executes one call: async tools are awaited, sync ones run in a thread pool sized
`max_concurrent_rollouts` so a slow tool delays only its own rollout. Nothing a call does crashes the
run: an unknown name, a malformed block, wrong arguments, an exception or a timeout each become an
error message to the model and a counted failure.
"""

import asyncio
import concurrent.futures
import inspect
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.chat.tool_calls import ToolCall, tool_schema
from tandem.errors import UsageError


@dataclass
class Toolbox:
    """The tools of one rollout: callables by name and their schemas for the chat template."""

    funcs: dict[str, Callable]
    schemas: list[dict]


@dataclass
class ToolResult:
    """One call: the tool message's content and how it went: "ok", "error" (raised or bad arguments), "timeout",
    "unknown" (no tool of that name: a policy error) or "malformed" (the call could not be parsed)."""

    name: str
    content: str
    status: str
    latency_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status != "ok"

    @property
    def invoked(self) -> bool:
        """The named tool was called (its per-tool metrics count this call)."""
        return self.status in ("ok", "error", "timeout")


class ToolRunner:
    """Executes tool calls with a per-call timeout. Python cannot stop a thread: a sync tool that outlasts its
    timeout is abandoned (its rollout moves on at once), and once half the pool is held by such threads the
    pool is replaced, so hung tools never starve the others."""

    def __init__(self, pool_size: int, timeout_s: float):
        self.pool_size, self.timeout_s = pool_size, timeout_s
        self.pool = self._new_pool()
        self.abandoned = 0

    def _new_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(self.pool_size, thread_name_prefix="tandem-tool")

    async def run_in_pool(self, func: Callable, *args, **kwargs):
        """`func(*args, **kwargs)` on the tool threads (environments' reset and get_reward run there too)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: func(*args, **kwargs))

    async def call(self, toolbox: Toolbox, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(call.name, error_message(f"malformed tool call: {call.error}"), "malformed")
        func = toolbox.funcs.get(call.name)
        if func is None:
            known = ", ".join(sorted(toolbox.funcs)) or "none"
            return ToolResult(
                call.name, error_message(f"unknown tool {call.name!r}; the tools are: {known}"), "unknown"
            )
        start = time.monotonic()
        status = "error"
        try:
            value = await asyncio.wait_for(self._invoke(func, call.arguments), self.timeout_s)
            return ToolResult(call.name, as_text(value), "ok", time.monotonic() - start)
        except TimeoutError:
            message, status = (
                f"tool {call.name!r} did not answer within {self.timeout_s:g}s (tool_call_timeout)",
                "timeout",
            )
        except TypeError as exc:  # wrong or missing arguments
            message = f"bad arguments for {call.name!r}: {exc}"
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
        return ToolResult(call.name, error_message(message), status, time.monotonic() - start)

    async def _invoke(self, func: Callable, arguments: dict):
        if inspect.iscoroutinefunction(func):
            return await func(**arguments)
        future = self.pool.submit(func, **arguments)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not future.cancel():  # already running: the thread is lost to the pool
                self._abandon()
            raise

    def _abandon(self) -> None:
        self.abandoned += 1
        if self.abandoned * 2 >= self.pool_size:
            self.pool.shutdown(wait=False, cancel_futures=False)
            self.pool, self.abandoned = self._new_pool(), 0

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def validate_tools(tools: list[Callable], owner: str = "tools") -> None:
    """Tools are registered by `__name__` and pickled to the worker: module-level functions (or an environment's
    methods), each described by type hints and a docstring, no two with one name. Raises naming the fix."""
    names: dict[str, Callable] = {}
    for tool in tools:
        name = getattr(tool, "__name__", None)
        if not callable(tool) or name is None:
            raise TypeError(
                f"{owner}: {tool!r} is not a function. Tools are registered by __name__: pass module-level "
                "functions (def name(...) with type hints and a docstring)"
            )
        if name == "<lambda>" or "<locals>" in getattr(tool, "__qualname__", ""):
            kind = "a lambda" if name == "<lambda>" else f"{tool.__qualname__!r}, a nested function,"
            raise TypeError(
                f"{owner}: {kind} cannot be a tool: tools are sent to the rollout worker by pickle and "
                "called by name. Define it with def at module level"
            )
        if name in names:
            raise UsageError(
                f"{owner}: two tools are named {name!r}; the model calls tools by name, so each name "
                "must be unique. Rename one"
            )
        names[name] = tool
        tool_schema(tool)  # raises naming the tool when hints or docstring are missing


def error_message(text: str) -> str:
    """A tool message that tells the model its call failed, as JSON: {"error": ...}."""
    return json.dumps({"error": text})


def as_text(value) -> str:
    """A tool's return value as the tool message's content: strings as they are, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)
