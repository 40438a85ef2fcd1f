"""`vllm serve`'s flags on `tandem serve`: those it implements act, as in vLLM; the others end the command with one
line saying why, before any model loads. Against real `tandem serve` processes."""

import http.client
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ServeProcess
from tests.serve.test_lora_and_reload import make_adapter
from tests.serve.test_streaming import sse_events

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ extra }}<|im_end|>\n{% endfor %}"
    "{% if reasoning_effort %}effort={{ reasoning_effort }} thinking={{ enable_thinking }}{% endif %}"
    "{% for d in documents or [] %}[{{ d.title }}]{% endfor %}"
)


@pytest.fixture(scope="module")
def flagged(tmp_path_factory):
    """One server with most of vLLM's response-shaping flags on."""
    folder = tmp_path_factory.mktemp("flags")
    make_adapter(folder / "alpha", seed=1)
    (folder / "template.jinja").write_text(TEMPLATE)
    s = ServeProcess(
        "--enable-lora",
        "--lora-modules",
        f"alpha={folder / 'alpha'}",
        "--return-tokens-as-token-ids",
        "--enable-prompt-tokens-details",
        "--enable-force-include-usage",
        "--enable-server-load-tracking",
        "--enable-tokenizer-info-endpoint",
        "--enable-request-id-headers",
        "--response-role",
        "helper",
        "--chat-template",
        str(folder / "template.jinja"),
        "--default-chat-template-kwargs",
        '{"extra": "!"}',
        "--step-delay-s",
        "0.02",
        "--stream-interval",
        "3",
        "--exclude-tools-when-tool-choice-none",
        "--enforce-eager",
        "--disable-log-requests",
        "--reasoning-effort-map",
        '{"max": "high"}',
        "--override-generation-config",
        '{"max_new_tokens": 9}',
        "--fingerprint-mode",
        "custom",
        "--fingerprint-value",
        "fp-1",
    )
    yield s
    s.close()


def test_lora_modules_are_served_from_the_start(flagged):
    names = [card["id"] for card in flagged.get("/v1/models")[1]["data"]]
    assert names[-1] == "alpha"
    status, answer = flagged.post("/v1/completions", {"prompt": [1, 5], "max_tokens": 2, "model": "alpha"})
    assert status == 200 and answer["model"] == "alpha"


def test_return_tokens_as_token_ids_is_the_requests_default(flagged):
    status, answer = flagged.post("/v1/completions", {"prompt": [1, 5], "max_tokens": 2, "logprobs": 1})
    assert all(token.startswith("token_id:") for token in answer["choices"][0]["logprobs"]["tokens"])
    status, answer = flagged.post(
        "/v1/completions", {"prompt": [1, 5], "max_tokens": 2, "logprobs": 1, "return_tokens_as_token_ids": False}
    )
    assert not any(token.startswith("token_id:") for token in answer["choices"][0]["logprobs"]["tokens"])


def test_prompt_tokens_details_count_the_cached_prompt(flagged):
    prompt = list(range(100, 150))
    first = flagged.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})[1]["usage"]["prompt_tokens_details"]
    again = flagged.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})[1]["usage"]["prompt_tokens_details"]
    assert first["cached_tokens"] == 0 and again["cached_tokens"] == 48, (first, again)


def test_force_include_usage_puts_usage_in_every_chunk_and_at_the_end(flagged):
    events = sse_events(
        flagged.port, "/v1/completions", {"prompt": [1, 5], "max_tokens": 7, "ignore_eos": True, "stream": True}
    )  # 7 tokens, whatever is sampled
    chunks = events[:-1]
    assert all("usage" in chunk for chunk in chunks) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 7 and "prompt_tokens_details" in chunks[-1]["usage"]
    token_chunks = [c for c in chunks if c["choices"]]
    assert len(token_chunks) == 3, "--stream-interval 3: the first token, then one chunk per 3 tokens (4, 7)"


def test_the_response_role_default_template_kwargs_and_server_template_apply(flagged):
    status, answer = flagged.post(
        "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2, "return_prompt_text": True}
    )
    assert answer["choices"][0]["message"]["role"] == "helper"
    assert answer["prompt_text"].startswith("<|im_start|>user\nWhat is 2 + 2?!")
    assert answer["system_fingerprint"] == "fp-1"


def test_reasoning_effort_documents_and_generation_defaults_reach_the_template_and_sampling(flagged):
    status, answer = flagged.post(
        "/v1/chat/completions",
        {
            "messages": QUESTION,
            "return_prompt_text": True,
            "reasoning_effort": "max",
            "documents": [{"title": "T"}],
            "ignore_eos": True,
        },
    )
    assert status == 200 and "effort=high thinking=True[T]" in answer["prompt_text"], answer["prompt_text"]
    assert answer["usage"]["completion_tokens"] == 9, "--override-generation-config's max_new_tokens caps the reply"


def test_tools_stay_out_of_the_prompt_when_tool_choice_is_none(flagged):
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    plain = flagged.post("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1})[1]["usage"]["prompt_tokens"]
    with_tools = flagged.post(
        "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1, "tools": [tool], "tool_choice": "none"}
    )[1]["usage"]["prompt_tokens"]
    assert with_tools == plain


def test_load_counts_the_requests_being_served(flagged):
    assert flagged.get("/load") == (200, {"server_load": 0})
    seen = []
    worker = threading.Thread(
        target=lambda: flagged.post("/v1/completions", {"prompt": [1], "max_tokens": 40, "ignore_eos": True})
    )
    worker.start()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        if flagged.get("/load")[1]["server_load"] == 1:
            seen.append(1)
    worker.join()
    assert seen and flagged.get("/load")[1] == {"server_load": 0}


def test_tokenizer_info_and_request_id_headers(flagged):
    status, info = flagged.get("/tokenizer_info")
    assert status == 200 and info["tokenizer_class"].startswith("Qwen2Tokenizer")
    assert info["chat_template"] == TEMPLATE and "vocab_file" not in info
    conn = http.client.HTTPConnection("127.0.0.1", flagged.port)
    conn.request("GET", "/health", headers={"X-Request-Id": "abc"})
    assert conn.getresponse().getheader("X-Request-Id") == "abc"


def test_a_plain_server_has_no_tokenizer_info_and_no_load():
    plain = ServeProcess()
    try:
        assert plain.get("/tokenizer_info")[0] == 404
        plain.post("/v1/completions", {"prompt": [1], "max_tokens": 1})
        assert plain.get("/load") == (200, {"server_load": 0}), "vLLM answers 0 without load tracking"
    finally:
        plain.close()


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size tunes vLLM's engine"),
        (["--gpu_memory_utilization=0.9"], "--gpu-memory-utilization tunes vLLM's engine"),
        (["--reasoning-parser", "qwen3"], "--reasoning-parser is not supported: tandem serve has no reasoning parsers"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype is not supported"),
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", '[{"name": "a", "path": "/x"}]'], "Invalid fields for --lora-modules"),
        (["--default-chat-template-kwargs", "{bad"], "is not JSON"),
        (["--enable-lora", "--lora-modules", "a=/nonexistent"], "--lora-modules a=/nonexistent: No adapter found"),
        (["--not-a-flag"], "unrecognized arguments: --not-a-flag"),
    ],
)
def test_a_flag_tandem_serve_does_not_take_is_one_line_and_exit_2(flags, line):
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "tiny", *flags], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and line in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_flags_that_ask_for_what_tandem_serve_does_anyway_are_taken(tmp_path):
    taken = ServeProcess(
        "--kv-cache-dtype",
        "auto",
        "--scheduling-policy",
        "fcfs",
        "--disable-prompt-embeds",
        "--enforce-eager",
        "--disable-lora",
        "--disable-prefix-caching",
    )
    try:
        assert taken.get("/health")[0] == 200
        assert 'enable_prefix_caching="False"' in taken.get("/metrics")[1]
        status, body = taken.post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path)})
        assert status == 500 and "LoRA is not enabled" in body["error"]["message"], "--disable-lora"
    finally:
        taken.close()
