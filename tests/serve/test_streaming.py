"""Streaming from `tandem serve` as the OpenAI SDK and raw SSE readers see it: the chunks join into the answer the
same request gets without streaming, directly and through `tandem proxy`; a client that leaves frees its slot."""

import http.client
import json
import time

import openai
import pytest

from tandem.generation.launcher import EmbeddedProxy
from tandem.tasks import TINY_MODEL_PATH

PROMPT = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
MESSAGES = [{"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture(scope="module")
def proxy(server):
    p = EmbeddedProxy([server.url])
    yield p
    p.stop()


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def sse_events(port: int, path: str, body: dict) -> list:
    """The `data:` payloads of one streamed answer, read as a plain HTTP client reads them."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    text = response.read().decode()
    conn.close()
    events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    assert all(not e.startswith("data:") for e in events)
    return [e if e == "[DONE]" else json.loads(e) for e in events]


@pytest.mark.parametrize("via", ["server", "proxy"])
def test_streamed_completions_join_into_the_non_streamed_answer(server, proxy, via):
    client = sdk(server.url if via == "server" else proxy.url)
    # the proxy splits a non-streamed batch into one request per prompt (prefilled apart, log-probs ~1e-7 away from
    # a batch's), and routes a streamed one whole: through it, one prompt
    prompt = [PROMPT, "Count: 1, 2,"] if via == "server" else PROMPT
    args = dict(
        model=TINY_MODEL_PATH,
        prompt=prompt,
        max_tokens=12,
        n=2,
        seed=5,
        logprobs=2,
        temperature=0.9,
        stop=[" 7"],
        extra_body={"return_token_ids": True},
    )
    whole = client.completions.create(**args)
    joined = {
        c.index: {"text": "", "ids": [], "lps": [], "tops": [], "offsets": [], "finish": None} for c in whole.choices
    }
    for chunk in client.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            usage = chunk.usage
            continue
        (c,) = chunk.choices
        j = joined[c.index]
        assert j["finish"] is None, "nothing follows a choice's finish_reason"
        j["text"] += c.text
        j["ids"] += c.model_extra["token_ids"]
        j["lps"] += c.logprobs.token_logprobs
        j["tops"] += c.logprobs.top_logprobs
        j["offsets"] += c.logprobs.text_offset
        j["finish"] = c.finish_reason
    for c in whole.choices:
        j = joined[c.index]
        assert j["text"] == c.text, f"choice {c.index}: streamed text differs"
        assert j["ids"] == c.model_extra["token_ids"] and j["finish"] == c.finish_reason
        assert j["lps"] == c.logprobs.token_logprobs and j["tops"] == c.logprobs.top_logprobs
        assert j["offsets"] == c.logprobs.text_offset
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("via", ["server", "proxy"])
def test_streamed_chat_joins_into_the_non_streamed_message(server, proxy, via):
    client = sdk(server.url if via == "server" else proxy.url)
    args = dict(
        model=TINY_MODEL_PATH,
        messages=MESSAGES,
        max_tokens=16,
        seed=9,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    whole = client.chat.completions.create(**args).choices[0]
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    deltas = [c.choices[0] for c in chunks[1:]]
    assert "".join(d.delta.content or "" for d in deltas) == whole.message.content
    assert sum((d.model_extra["token_ids"] for d in deltas), []) == whole.model_extra["token_ids"]
    assert [t for d in deltas for t in d.logprobs.content] == whole.logprobs.content
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [whole.finish_reason]


def test_sse_framing_usage_echo_and_held_back_stop_strings(server):
    body = {
        "prompt": "Count: 1, 2,",
        "max_tokens": 8,
        "seed": 1,
        "echo": True,
        "logprobs": 0,
        "stop": [", 5"],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = sse_events(server.port, "/v1/completions", body)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and "usage" in events[-2]
    chunks = events[:-2]
    assert chunks[0]["choices"][0]["text"].startswith("Count: 1, 2,"), "echo: the first chunk starts with the prompt"
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None, "the prompt's first token has no log-prob"
    assert [c["usage"]["completion_tokens"] for c in chunks] == sorted(c["usage"]["completion_tokens"] for c in chunks)
    status, whole = server.post("/v1/completions", {**body, "stream": False, "stream_options": None})
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert ", 5" not in "".join(c["choices"][0]["text"] for c in chunks), "a stop string is never streamed"
    status, error = server.post("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True})
    assert status == 400 and error["error"]["message"].startswith(
        "`prompt_logprobs` are not available when `stream=True`."
    )


@pytest.mark.parametrize("via", ["server", "proxy"])
def test_a_client_that_leaves_mid_stream_frees_its_slot_at_once(server, proxy, via):
    """Through the proxy too: its first chunk arrives while the replica still generates (passed on, not buffered)."""
    engine = server.server.engine
    port = server.port if via == "server" else int(proxy.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}),
        headers={"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")
    deadline = time.monotonic() + 5
    while engine.stats().running != 1 and time.monotonic() < deadline:  # stats are published at the step's end
        time.sleep(0.01)
    assert engine.stats().running == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 5
    while engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().running == 0, "the abandoned stream still holds a slot"


def test_the_chunks_are_one_per_token_however_late_the_server_reads_the_engine():
    from transformers import AutoTokenizer

    from tandem.serve.protocol import ChatCompletionRequest
    from tandem.serve.requests import EngineRequest
    from tandem.serve.responses import ChatReply, TokenText
    from tandem.serve.sampling import SamplingParams
    from tandem.serve.streaming import ChatStream, StreamOptions

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_PATH)
    answer = tokenizer.encode("3") + [tokenizer.eos_token_id]  # "3" then the end: vLLM streams "3", then the finish

    def streamed(read_after: list[int]) -> list[dict]:
        request = EngineRequest(prompt=[1, 2, 3], params=SamplingParams(temperature=0.0))
        req = ChatCompletionRequest(messages=MESSAGES, stream=True)
        stream = ChatStream(
            req,
            [request],
            "chatcmpl-1",
            "m",
            "fp",
            TokenText(tokenizer),
            [],
            StreamOptions(),
            reply=ChatReply.of(req, "assistant", TokenText(tokenizer), None),
        )
        seq, chunks = request.sequences[0], stream.chunks()
        for step, token in enumerate(answer, 1):  # the engine appends a token, then checks it (or ends the sequence)
            seq.output.append(token), seq.logprobs.append(-0.1), seq.top_logprobs.append([])
            if step == len(answer):
                seq.finish_reason = "stop"
            else:
                seq.checked = step
            if step in read_after:
                chunks += stream.chunks()
        return [c["choices"][0] | {"at": None} for c in chunks]

    each_step, at_the_end = streamed(read_after=[1, 2]), streamed(read_after=[2])
    assert at_the_end == each_step, "a server that reads late sends the same chunks"
    assert [c["delta"] for c in each_step] == [{"role": "assistant", "content": ""}, {"content": "3"}, {}]
    assert [c["finish_reason"] for c in each_step] == [None, None, "stop"]
