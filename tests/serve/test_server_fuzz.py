"""Malformed bodies to every endpoint never meet a server bug, and a server bug is never passed off as the client's.

The server answers the client's mistakes 4xx and its own bugs 500 (with the traceback in its log), so
"no 500 on malformed input" is what shows that validation, not luck, handled every body.
"""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

POST_ENDPOINTS = [
    "/v1/completions",
    "/v1/chat/completions",
    "/inference/v1/generate",
    "/tokenize",
    "/detokenize",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/collective_rpc",
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(
    [
        "prompt",
        "messages",
        "token_ids",
        "tokens",
        "sampling_params",
        "max_tokens",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "logprobs",
        "prompt_logprobs",
        "seed",
        "stop",
        "stop_token_ids",
        "model",
        "lora_name",
        "lora_path",
        "method",
        "kwargs",
        "top_logprobs",
        "stream",
        "repetition_penalty",
        "max_completion_tokens",
    ]
)
bodies = st.dictionaries(field_names, json_values, max_size=6) | json_values


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(endpoint=st.sampled_from(POST_ENDPOINTS), body=bodies)
def test_malformed_json_bodies_never_meet_a_server_bug(server, endpoint, body):
    status, answer = server.post(endpoint, body)
    assert status < 500, f"server bug: {endpoint} answered {status} to {json.dumps(body)[:200]}: {answer}"
    if status != 200:  # a body can be valid by chance; it must then have been served
        assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["code"] == status, (
            answer
        )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(endpoint=st.sampled_from(POST_ENDPOINTS), raw=st.binary(max_size=64))
def test_bytes_that_are_not_json_get_a_400(server, endpoint, raw):
    try:
        json.loads(raw)
        return
    except (ValueError, UnicodeDecodeError):
        pass
    status, answer = server.request("POST", endpoint, raw=raw)
    assert status == 400 and "error" in answer, (endpoint, raw, answer)


def test_the_server_still_serves_after_the_fuzzing(server):
    assert server.get("/health")[0] == 200
    status, body = server.post("/v1/completions", {"prompt": [1, 5, 6], "max_tokens": 2})
    assert status == 200 and len(body["choices"]) == 1


def test_a_server_bug_is_a_500_with_its_traceback_logged_and_the_server_keeps_serving(server, monkeypatch, caplog):
    def broken_encode(*args, **kwargs):
        raise ValueError("a bug inside the server")  # a ValueError: not the client's fault for all that

    monkeypatch.setattr(server.server.tokenizer, "encode", broken_encode)
    status, answer = server.post("/tokenize", {"prompt": "What is 1 + 1?"})
    assert status == 500 and answer["error"]["type"] == "InternalServerError", answer
    assert "a bug inside the server" in answer["error"]["message"]
    assert "Traceback" in caplog.text and "broken_encode" in caplog.text, "the traceback goes to the server log"
    monkeypatch.undo()
    assert server.post("/tokenize", {"prompt": "What is 1 + 1?"})[0] == 200


def test_a_failure_inside_an_engine_step_is_a_500_and_the_engine_serves_the_next_request(server, monkeypatch, caplog):
    """One forward that raises (a model the engine meets a case of for the first time, say) fails the requests of that
    step alone: /health stays 200 and the next request is served."""
    forward = server.server.engine.runner.window_forward

    def fails_once(*args, **kwargs):
        monkeypatch.setattr(server.server.engine.runner, "window_forward", forward)
        raise RuntimeError("a forward that broke")

    monkeypatch.setattr(server.server.engine.runner, "window_forward", fails_once)
    status, answer = server.post("/v1/completions", {"prompt": [1, 5, 6], "max_tokens": 3, "n": 2})
    assert status == 500 and "a forward that broke" in answer["error"]["message"], answer
    assert "Traceback" in caplog.text and "fails_once" in caplog.text, "the traceback goes to the server log"
    assert server.get("/health")[0] == 200, "the engine survived its failed step"
    status, body = server.post("/v1/completions", {"prompt": [1, 5, 6], "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
