"""The engine never dies of a request: 150 generated bodies, valid and not, to the generation, tokenizer and
control routes of a real `tandem serve` process. Each answer is a 2xx, or a 4xx in vLLM's error shape (a 500 only
where vLLM answers one: a failed adapter load), and after every body `/health` and a plain completion still work.

Bodies are built from valid requests, then changed in zero to two places: a value of the wrong type or out of range,
an unknown field, a huge or empty prompt, odd unicode, a batch mixing good and bad prompts. Control bodies name only
127.0.0.1 and local paths; a pause is undone after each body. Derandomized: the same bodies on every run
(FUZZ_EXAMPLES=1500 FUZZ_RANDOM=1 hunts further, with new bodies each time).
"""

import collections
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ServeProcess
from tests.serve.test_lora_and_reload import make_adapter

VOCAB = 512
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", 150))
ENGINE_STOPPED = "The generation engine has stopped"
VLLM_500 = {"/v1/load_lora_adapter": "Call to add_lora method failed: "}
"""The routes where vLLM itself answers a refused body with a 500, and the start of its message."""

token = st.integers(0, VOCAB - 1)
prompt_ids = st.lists(token, min_size=1, max_size=24)
text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 6),
        "temperature": st.sampled_from([0.0, 0.7, 1.0]),
        "top_p": st.floats(0.1, 1.0),
        "top_k": st.integers(-1, 40),
        "min_p": st.floats(0.0, 0.5),
        "seed": st.integers(0, 2**31),
        "repetition_penalty": st.floats(0.5, 2.0),
        "presence_penalty": st.floats(-2, 2),
        "stop": st.lists(text, max_size=2),
        "stop_token_ids": st.lists(token, max_size=3),
        "min_tokens": st.integers(0, 2),
        "ignore_eos": st.booleans(),
        "logit_bias": st.dictionaries(token.map(str), st.floats(-100, 100), max_size=3),
        "allowed_token_ids": st.lists(token, min_size=1, max_size=5),
        "bad_words": st.lists(text, max_size=2),
        "skip_special_tokens": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "cache_salt": st.text(st.characters(categories=["L", "N"]), min_size=1, max_size=8),
        "repetition_detection": st.fixed_dictionaries(
            {
                "max_pattern_size": st.integers(0, 6),
                "min_pattern_size": st.integers(0, 3),
                "min_count": st.integers(0, 4),
            }
        ),
        "return_weight_versions": st.booleans(),
        "stream_interval": st.integers(1, 4),
    },
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system"]),
            "content": text
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=2),
        }
    ),
    min_size=1,
    max_size=3,
)

completions = st.builds(
    lambda p, s, extra: {"prompt": p, **s, **extra},
    prompt_ids | text | st.lists(prompt_ids, min_size=1, max_size=3),
    sampling,
    st.fixed_dictionaries(
        {},
        optional={
            "logprobs": st.integers(0, 5),
            "echo": st.booleans(),
            "return_token_ids": st.booleans(),
            "truncate_prompt_tokens": st.integers(1, 30),
            "logprob_token_ids": st.lists(token, max_size=3),
            "prompt_logprobs": st.integers(0, 3),
            "stream": st.booleans(),
        },
    ),
)
chats = st.builds(
    lambda m, s, extra: {"messages": m, **s, **extra},
    messages,
    sampling,
    st.fixed_dictionaries(
        {},
        optional={
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(0, 5),
            "return_prompt_text": st.booleans(),
            "echo": st.booleans(),
            "stream": st.booleans(),
            "max_completion_tokens": st.integers(1, 6),
        },
    ),
)
generates = (
    st.builds(  # max_tokens given (else the rest of the context: 5 s a body on a CPU), as the other routes' default
        lambda p, s: {"token_ids": p, "sampling_params": {"max_tokens": 6, **s}}, prompt_ids, sampling
    )
)
tokenizes = st.builds(lambda p: {"prompt": p}, text) | st.builds(lambda m: {"messages": m}, messages)
detokenizes = st.builds(lambda t: {"tokens": t}, st.lists(token, max_size=20))

bad_value = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    text,
    st.lists(st.integers(-5, 10**6), max_size=4),
    st.dictionaries(text, st.integers(), max_size=2),
    st.just([list(range(2000))]),
    st.just([]),
    st.just("\ud83d\ude00\u200b\x00"),
    st.just([[1, 2], [600]]),
)
field_name = st.sampled_from(
    [
        "prompt",
        "messages",
        "max_tokens",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "logprobs",
        "top_logprobs",
        "seed",
        "stop",
        "stop_token_ids",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "truncate_prompt_tokens",
        "cache_salt",
        "min_tokens",
        "sampling_params",
        "token_ids",
        "tokens",
        "echo",
        "stream",
        "use_beam_search",
        "response_format",
        "repetition_detection",
        "logprob_token_ids",
        "an_unknown_field",
    ]
)


def mutated(body_strategy):
    """A valid body (about half of them) or one changed in one or two places."""
    changes = st.lists(st.tuples(field_name, bad_value), max_size=2)
    return st.builds(
        lambda body, edits, keep: body if keep else {**body, **dict(edits)}, body_strategy, changes, st.booleans()
    )


def control_bodies(adapters: dict[str, str]):
    path = st.sampled_from(list(adapters.values()) + ["/nonexistent/adapter", "relative/path"])
    return st.one_of(
        st.tuples(
            st.just("/v1/load_lora_adapter"),
            st.builds(
                lambda n, p, i: {"lora_name": n, "lora_path": p, "load_inplace": i},
                st.sampled_from(["a", "b", "tiny"]),
                path,
                st.booleans(),
            ),
        ),
        st.tuples(
            st.just("/v1/unload_lora_adapter"), st.builds(lambda n: {"lora_name": n}, st.sampled_from(["a", "b", ""]))
        ),
        st.tuples(
            st.just("/collective_rpc"),
            st.builds(lambda p: {"method": "reload_weights", "kwargs": {"weights_path": p}}, path),
        ),
        st.tuples(
            st.sampled_from(
                [
                    "/pause?mode=keep",
                    "/pause?mode=abort",
                    "/pause?mode=wait",
                    "/pause?mode=sideways",
                    "/resume",
                    "/reset_prefix_cache",
                    "/start_weight_update",
                    "/finish_weight_update",
                ]
            ),
            st.just({}),
        ),
    )


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    make_adapter(root / "good", seed=1)
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text(
        '{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}'
    )
    os.environ["HF_HUB_OFFLINE"] = "1"  # inherited by the server: no path is ever looked up on the Hub
    s = ServeProcess(
        "--enable-lora",
        "--max-loras",
        "2",
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
        "--weight-transfer-config",
        '{"backend": "gloo"}',
    )
    s.adapters = {"good": str(root / "good"), "broken": str(root / "broken")}
    yield s
    s.close()


def stream_errors(answer) -> list[dict]:
    """The error events of a streamed answer (server-sent events), [] for any other answer."""
    if not isinstance(answer, str):
        return []
    events = [json.loads(line[len("data: ") :]) for line in answer.splitlines() if line.startswith("data: {")]
    return [event["error"] for event in events if "error" in event]


def vllm_shaped(status: int, answer) -> bool:
    error = answer.get("error") if isinstance(answer, dict) else None
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and error["code"] == status


def test_no_body_breaks_the_engine(fuzzed):
    statuses: collections.Counter = collections.Counter()
    routes = st.one_of(
        st.tuples(st.just("/v1/completions"), mutated(completions)),
        st.tuples(st.just("/v1/chat/completions"), mutated(chats)),
        st.tuples(st.just("/inference/v1/generate"), mutated(generates)),
        st.tuples(st.just("/tokenize"), mutated(tokenizes)),
        st.tuples(st.just("/detokenize"), mutated(detokenizes)),
        control_bodies(fuzzed.adapters),
    )

    @settings(
        max_examples=EXAMPLES,
        derandomize=not os.environ.get("FUZZ_RANDOM"),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(call=routes)
    def one_body(call):
        path, body = call
        status, answer = fuzzed.post(path, body)
        statuses[status] += 1
        said = str(answer)
        assert ENGINE_STOPPED not in said, f"{path} {body}: {said[:300]}"
        if status >= 500:
            assert path in VLLM_500 and answer["error"]["message"].startswith(VLLM_500[path]), (
                f"server error: {path} answered {status} to {str(body)[:200]}: {said[:300]}"
            )
        if status >= 400 and path.startswith(("/v1", "/inference", "/tokenize", "/detokenize")):
            assert vllm_shaped(status, answer), f"{path} {status} is not in vLLM's error shape: {said[:300]}"
        for event in stream_errors(answer):  # a stream's failure comes after its 200, as an event
            assert event["code"] < 500, f"{path} {str(body)[:200]} streamed a server error: {event}"
        fuzzed.post("/resume")
        assert fuzzed.get("/health")[0] == 200, f"after {path} {str(body)[:200]} the server is unhealthy"
        check, reply = fuzzed.post("/v1/completions", {"prompt": [1, 5, 6], "max_tokens": 1})
        assert check == 200, f"after {path} {str(body)[:200]} a plain completion got {check}: {reply}"

    one_body()
    print("\nstatuses of", sum(statuses.values()), "bodies:", dict(sorted(statuses.items())))
    answered = sum(n for status, n in statuses.items() if status < 300)
    assert answered >= sum(statuses.values()) / 3, f"fewer than a third of the bodies were valid: {dict(statuses)}"
