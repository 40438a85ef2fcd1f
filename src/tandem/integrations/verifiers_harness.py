"""A verifiers.v1 harness that needs nothing from the network: an in-process chat loop over the task's MCP tools.

Name it in an agent's config, `vf.AgentConfig(harness={"id": "tandem_harness"},
runtime=vf.SubprocessConfig())`. verifiers' own `bash` and `null` harnesses run their loop as a uv script, which
installs uv and its dependencies from PyPI the first time; this one runs in the rollout worker. Each round it sends the
conversation to the episode's endpoint (verifiers' interception server, which records the trace and, under tandem,
samples through the trainer's server), runs the reply's tool calls on the MCP servers in order, and stops at a reply
without calls, at `max_rounds`, or when verifiers refuses the next call (max_turns, a stop condition).
"""

import asyncio
import contextvars
import importlib
import json
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import verifiers.v1 as vf
from openai import APIStatusError, AsyncOpenAI, DefaultAsyncHttpxClient

from tandem.rollout.tools import ToolResult

TOOL_RESULTS: contextvars.ContextVar[list | None] = contextvars.ContextVar("verifiers_tool_results", default=None)
"""A rollout's tool calls as this harness reports them to tandem's loop (its tools/* metrics), when it runs under one."""


CONNECTIONS: dict[tuple[asyncio.AbstractEventLoop, float], "Connections"] = {}
"""The shared clients, by event loop and tool timeout."""


class ChatHarnessConfig(vf.HarnessConfig):
    max_rounds: int = 8
    """Model calls in one episode at most (the agent's max_turns may stop it sooner)."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + (
            [{"role": "user", "content": prompt}]
            if isinstance(prompt, str)
            else [m.model_dump(exclude_none=True) for m in prompt or []]
        )
        connections = self.connections()
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=connections.model)
        async with AsyncExitStack() as stack:
            tools = await McpTools.open(stack, mcp_urls, connections.tools, set(self.config.disabled_tools or []))
            for _ in range(self.config.max_rounds):
                try:
                    reply = (
                        (
                            await client.chat.completions.create(
                                model=ctx.model, messages=messages, tools=tools.tools or None
                            )
                        )
                        .choices[0]
                        .message
                    )
                except APIStatusError:
                    if trace.stop_condition is None:  # refused for a stop condition (max_turns, context length): done
                        raise
                    break
                messages.append(reply.model_dump(exclude_none=True))
                if not reply.tool_calls:
                    break
                for call in reply.tool_calls:  # in order: they may share the task's state
                    content = await tools.call(call.function.name, call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    def connections(self) -> "Connections":
        """The HTTP clients every episode on this event loop shares (verifiers makes a harness per episode): a new
        client's SSL context alone costs ~20 ms of CPU, a third of the worker's time when each episode made its own."""
        key = (asyncio.get_running_loop(), self.config.tool_timeout)
        if key not in CONNECTIONS:
            CONNECTIONS[key] = Connections(DefaultAsyncHttpxClient(), mcp_http_client(self.config.tool_timeout))
        return CONNECTIONS[key]


async def close_connections() -> None:
    """Close the clients of this event loop's episodes (the loop that plays them calls it when it ends)."""
    loop = asyncio.get_running_loop()
    for key in [key for key in CONNECTIONS if key[0] is loop]:
        connections = CONNECTIONS.pop(key)
        await connections.model.aclose()
        await connections.tools.aclose()


class HttpClient(Protocol):
    """An async HTTP client (httpx's, or httpx2's under mcp 2), closed when the event loop that used it ends."""

    async def aclose(self) -> None: ...


class ToolSession(Protocol):
    """An open MCP client session: what a tool call needs of it."""

    async def call_tool(self, name: str, arguments: dict[str, Any], /) -> Any: ...


@dataclass
class Connections:
    model: HttpClient
    """To the episode's endpoint (verifiers' interception server)."""
    tools: HttpClient
    """To the MCP tool servers."""


class McpTools:
    """An episode's tools: one MCP session per server, open for the whole episode (a session's handshake costs more
    than a call), the tools as chat `tools` (named `<server>_<tool>`, or bare from a server without a prefix)."""

    def __init__(self, tools: list[dict], routes: dict[str, tuple[ToolSession, str]]):
        self.tools, self.routes = tools, routes

    @classmethod
    async def open(cls, stack: AsyncExitStack, mcp_urls: dict[str, str], http, disabled: set[str]) -> "McpTools":
        """The tools of every server but those the harness config disables (by their advertised name)."""
        tools, routes = [], {}
        for server, url in mcp_urls.items():
            session = await stack.enter_async_context(mcp_session(url, http))
            for tool in (await session.list_tools()).tools:
                name = f"{server}_{tool.name}" if server else tool.name
                if name in disabled:
                    continue
                routes[name] = (session, tool.name)
                schema = getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None)  # mcp 2 / mcp 1
                tools.append(
                    {
                        "type": "function",
                        "function": {"name": name, "description": tool.description or "", "parameters": schema},
                    }
                )
        return cls(tools, routes)

    async def call(self, name: str, arguments: str) -> str:
        """One call's tool message; every failure is an error message to the model and a counted failure."""
        start, status = time.monotonic(), "ok"
        if name not in self.routes:
            content, status = (
                f"error: unknown tool {name!r}; the tools are: {', '.join(sorted(self.routes)) or 'none'}",
                "unknown",
            )
        else:
            try:
                session, tool = self.routes[name]
                result = await session.call_tool(tool, json.loads(arguments or "{}"))
                content = "\n".join(getattr(block, "text", str(block)) for block in result.content)
                status = "error" if (getattr(result, "is_error", None) or getattr(result, "isError", False)) else "ok"
            except Exception as exc:  # noqa: BLE001 - bad JSON, a tool that raised, a server that failed: the model is told
                content, status = f"error: {exc}", "error"
        results = TOOL_RESULTS.get()
        if results is not None:
            results.append(ToolResult(name, content, status, time.monotonic() - start))
        return content


def mcp_http_client(timeout_s: float):
    """An HTTP client for MCP sessions: mcp 1.x (verifiers 0.3) or mcp 2.x (verifiers 0.4, on httpx2)."""
    import mcp
    from mcp.client.streamable_http import create_mcp_http_client

    # mcp 2 builds on httpx2, mcp 1 on httpx: the Timeout is the installed mcp's own
    httpx: Any = importlib.import_module("httpx2" if hasattr(mcp, "Client") else "httpx")
    return create_mcp_http_client(timeout=httpx.Timeout(timeout_s, connect=5.0))


@asynccontextmanager
async def mcp_session(url: str, http):
    """One MCP streamable-HTTP session over `http`: mcp 2.x's Client, or mcp 1.x's ClientSession."""
    import mcp
    from mcp.client.streamable_http import streamable_http_client

    transport = streamable_http_client(url, http_client=http)
    async with AsyncExitStack() as stack:
        if hasattr(mcp, "Client"):
            yield await stack.enter_async_context(mcp.Client(transport))
            return
        from mcp import ClientSession

        read, write, *_ = await stack.enter_async_context(transport)
        session = await stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        yield session


__all__ = ["ChatHarness"]
