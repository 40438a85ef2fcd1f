"""Request fields of vLLM's protocol that change an answer act in `tandem serve` as in vLLM, or are refused with a
400 naming them: never accepted and ignored. Against a real `tandem serve` process."""

import pytest

from tests.conftest import ServeProcess
from tests.serve.test_prefix_cache import counter

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def serve():
    s = ServeProcess("--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1", "--enable-scale-out")
    yield s
    s.close()


def chat(serve, **fields) -> dict:
    status, answer = serve.post(
        "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 6, "temperature": 0} | fields
    )
    assert status == 200, answer
    return answer


def complete(serve, **fields) -> dict:
    status, answer = serve.post("/v1/completions", {"prompt": [1, 5, 6, 7], "max_tokens": 6, "temperature": 0} | fields)
    assert status == 200, answer
    return answer


def refusal(serve, path: str, body: dict) -> str:
    status, answer = serve.post(path, body)
    assert status == 400, f"{body} should be a 400, got {status}: {answer}"
    return answer["error"]["message"]


# ---- message content ----------------------------------------------------------------------------------------------


def test_text_parts_are_joined_for_a_template_that_reads_strings(serve):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]}]
    joined = [{"role": "user", "content": "What is\n2 + 2?"}]
    ids = [serve.post("/tokenize", {"messages": m})[1]["tokens"] for m in (parts, joined)]
    assert ids[0] == ids[1], "text parts must render as their newline-joined text (vLLM's join)"
    assert (
        chat(serve, messages=parts)["choices"][0]["message"]["content"]
        == chat(serve, messages=joined)["choices"][0]["message"]["content"]
    )


def test_a_part_that_is_not_text_is_a_400_naming_it(serve):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    assert "'image_url'" in refusal(serve, "/v1/chat/completions", {"messages": image})


# ---- sampling fields ------------------------------------------------------------------------------------------------


def test_logit_bias_moves_the_greedy_choice_on_every_route(serve):
    bias = {"logit_bias": {"42": 100}}
    assert complete(serve, **bias, return_token_ids=True)["choices"][0]["token_ids"] == [42] * 6
    assert chat(serve, **bias, return_token_ids=True)["choices"][0]["token_ids"] == [42] * 6
    status, body = serve.post(
        "/inference/v1/generate",
        {"token_ids": [1, 5, 6], "sampling_params": {"max_tokens": 3, "temperature": 0, "logit_bias": {"42": 100}}},
    )
    assert status == 200 and body["choices"][0]["token_ids"] == [42] * 3


def test_logit_bias_is_clamped_on_v1_routes_and_checked(serve):
    clamped = complete(serve, logit_bias={"42": 500, "7": -300}, logprobs=0, temperature=1.0, seed=1)
    at_bounds = complete(serve, logit_bias={"42": 100, "7": -100}, logprobs=0, temperature=1.0, seed=1)
    assert clamped["choices"][0]["logprobs"] == at_bounds["choices"][0]["logprobs"]
    assert "cannot be converted to integer token IDs: ['abc']" in refusal(
        serve, "/v1/completions", {"prompt": [1, 2], "logit_bias": {"abc": 1}}
    )
    assert "in logit_bias contain out-of-vocab token ids. Vocabulary size: 512" in refusal(
        serve, "/v1/completions", {"prompt": [1, 2], "logit_bias": {"512": 1}}
    )


def test_allowed_token_ids_confine_sampling_and_the_processed_log_probs(serve):
    allowed = [10, 11, 12]
    answer = complete(
        serve, allowed_token_ids=allowed, temperature=1.0, seed=3, logprobs=5, return_token_ids=True, max_tokens=12
    )
    choice = answer["choices"][0]
    assert set(choice["token_ids"]) <= set(allowed)
    listed = [v for top in choice["logprobs"]["top_logprobs"] for v in top.values()]
    assert sum(v > -9999.0 for v in listed) <= 3 * len(choice["token_ids"]), "a disallowed token kept probability"
    assert "allowed_token_ids is not None and empty!" in refusal(
        serve, "/v1/completions", {"prompt": [1], "allowed_token_ids": []}
    )
    assert "allowed_token_ids contains out-of-vocab token id!" in refusal(
        serve, "/v1/completions", {"prompt": [1], "allowed_token_ids": [600]}
    )


def test_a_request_whose_masks_leave_no_token_fails_alone(serve):
    eos = serve.post("/tokenize", {"prompt": "<|im_end|>", "add_special_tokens": False})[1]["tokens"][0]
    message = refusal(serve, "/v1/completions", {"prompt": [1, 2], "allowed_token_ids": [eos], "min_tokens": 2})
    assert "No token is left to sample" in message
    complete(serve)  # the engine serves on


def test_bad_words_are_never_completed(serve):
    choices = {"allowed_token_ids": [10, 11], "max_tokens": 8, "return_token_ids": True}  # '$' and '%'
    favourite = complete(serve, **choices)["choices"][0]["token_ids"][0]
    word = serve.post("/detokenize", {"tokens": [favourite]})[1]["prompt"]
    banned = complete(serve, **choices, bad_words=[word])["choices"][0]["token_ids"]
    assert favourite not in banned, f"{word!r} was generated"
    pair = complete(serve, **choices, bad_words=["$%", "%$"])["choices"][0]["token_ids"]
    assert all(pair[i : i + 2] not in ([10, 11], [11, 10]) for i in range(len(pair) - 1)), (
        f"a two-token bad word: {pair}"
    )
    assert "bad_words cannot contain an empty string" in refusal(
        serve, "/v1/completions", {"prompt": [1], "bad_words": [""]}
    )


def test_stop_strings_are_looked_for_past_min_tokens_only(serve):
    choice = complete(serve, allowed_token_ids=[10], stop=["$"], min_tokens=3, max_tokens=8)["choices"][0]  # '$'
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("$$$", "stop", "$")
    assert complete(serve, allowed_token_ids=[10], stop=["$"], max_tokens=8)["choices"][0]["text"] == ""


def test_repetition_detection_ends_a_looping_reply(serve):
    choice = complete(
        serve,
        allowed_token_ids=[9],
        max_tokens=20,
        repetition_detection={"max_pattern_size": 2, "min_pattern_size": 1, "min_count": 3},
    )["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("repetition", "repetition_detected")
    assert choice["text"] == serve.post("/detokenize", {"tokens": [9, 9, 9]})[1]["prompt"]
    assert "min_count must be >= 2" in refusal(
        serve, "/v1/completions", {"prompt": [1], "repetition_detection": {"max_pattern_size": 2, "min_count": 1}}
    )


def test_logprob_token_ids_report_those_tokens_at_every_position(serve):
    listed = [3, 17, 200]
    everything = complete(serve, logprobs=-1, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    asked = complete(serve, logprobs=0, logprob_token_ids=listed, return_tokens_as_token_ids=True)["choices"][0][
        "logprobs"
    ]
    for whole, part in zip(everything["top_logprobs"], asked["top_logprobs"]):
        assert {f"token_id:{t}" for t in listed} <= set(part) and len(part) <= 4
        assert all(part[key] == whole[key] for key in part), "a listed token's log-prob differs from the full reading"
    content = chat(serve, logprobs=True, logprob_token_ids=listed)["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) in (3, 4) for entry in content)
    assert "`logprobs` must be set to true" in refusal(
        serve, "/v1/chat/completions", {"messages": QUESTION, "logprob_token_ids": listed}
    )
    assert "`logprobs` must be set." in refusal(serve, "/v1/completions", {"prompt": [1], "logprob_token_ids": listed})


def test_chat_top_logprobs_minus_one_lists_the_whole_vocabulary(serve):
    content = chat(serve, logprobs=True, top_logprobs=-1, max_tokens=2)["choices"][0]["logprobs"]["content"]
    assert [len(entry["top_logprobs"]) for entry in content] == [512, 512]


# ---- prompt fields --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncate_prompt_tokens_keeps_the_side_asked_for(serve, side):
    prompt = list(range(20, 40))
    kept = prompt[-8:] if side == "left" else prompt[:8]
    truncated = complete(serve, prompt=prompt, truncate_prompt_tokens=8, truncation_side=side, return_token_ids=True)
    assert truncated["usage"]["prompt_tokens"] == 8
    assert (
        truncated["choices"][0]["token_ids"]
        == complete(serve, prompt=kept, return_token_ids=True)["choices"][0]["token_ids"]
    )
    assert chat(serve, truncate_prompt_tokens=5)["usage"]["prompt_tokens"] == 5
    assert "cannot be greater than max_model_len = 1024" in refusal(
        serve, "/v1/completions", {"prompt": prompt, "truncate_prompt_tokens": 2000}
    )


def test_max_tokens_beyond_the_context_is_refused_on_v1_routes(serve):
    assert "max_tokens=2000 cannot be greater than max_model_len=1024" in refusal(
        serve, "/v1/completions", {"prompt": [1], "max_tokens": 2000}
    )
    assert "max_completion_tokens=2000 cannot be greater" in refusal(
        serve, "/v1/chat/completions", {"messages": QUESTION, "max_completion_tokens": 2000}
    )


def prefix_hits(serve) -> float:
    return counter(serve, "vllm:prefix_cache_hits_total")


def test_cache_salts_keep_prefix_caches_apart(serve):
    prompt = list(range(100, 164))  # four whole blocks

    complete(serve, prompt=prompt, cache_salt="alice")
    before = prefix_hits(serve)
    complete(serve, prompt=prompt, cache_salt="bob")
    assert prefix_hits(serve) == before, "a different salt read another's blocks"
    complete(serve, prompt=prompt, cache_salt="alice")
    assert prefix_hits(serve) > before, "the same salt shares its blocks"
    assert "must be a non-empty string" in refusal(serve, "/v1/completions", {"prompt": prompt, "cache_salt": ""})
    assert "must not contain '@'" in refusal(serve, "/v1/completions", {"prompt": prompt, "cache_salt": "a@b"})


# ---- chat fields ----------------------------------------------------------------------------------------------------


def test_chat_echo_starts_a_continued_message_with_its_text(serve):
    messages = QUESTION + [{"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False, "echo": True}
    choice = chat(serve, **body)["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"].startswith("The answer is")
    status, body = serve.post("/v1/chat/completions", {"messages": messages, "continue_final_message": True})
    assert status == 400 and "not compatible" in body["error"]["message"], (
        "vLLM's refusal without add_generation_prompt"
    )


def test_return_prompt_text_is_the_rendered_conversation(serve):
    answer = chat(serve, return_prompt_text=True, return_token_ids=True)
    tokens = serve.post("/tokenize", {"messages": QUESTION})[1]["tokens"]
    assert answer["prompt_token_ids"] == tokens and "What is 2 + 2?" in answer["prompt_text"]


def test_a_chat_template_in_the_request_needs_the_servers_trust(serve):
    message = refusal(serve, "/v1/chat/completions", {"messages": QUESTION, "chat_template": "{{ messages }}"})
    assert "--trust-request-chat-template is not set" in message


# ---- refused and default values -------------------------------------------------------------------------------------


def test_fields_at_their_defaults_are_accepted(serve):
    defaults = {
        "logit_bias": None,
        "use_beam_search": False,
        "response_format": {"type": "text"},
        "suffix": None,
        "prompt_embeds": None,
        "thinking_token_budget": -1,
        "structured_outputs": None,
        "user": "me",
        "priority": 0,
        "watermarking": None,
        "length_penalty": 1.0,
        "vllm_xargs": {"k": 1},
    }
    complete(serve, **defaults)
    complete(serve, echo=None, stream=None)  # null where vLLM's types allow it: the default
    chat(serve, n=None, logprobs=None, stream=None)


@pytest.mark.parametrize(
    "field, value",
    [
        ("use_beam_search", True),
        ("suffix", "end"),
        ("prompt_embeds", "AAAA"),
        ("response_format", {"type": "json_object"}),
        ("thinking_token_budget", 10),
        ("structured_outputs", {"regex": "[0-9]+"}),
    ],
)
def test_what_tandem_serve_does_not_implement_is_a_400_naming_the_field(serve, field, value):
    message = refusal(serve, "/v1/completions", {"prompt": [1], field: value})
    assert message.startswith(f"`{field}` is not supported by tandem serve: ")


# ---- /invocations ---------------------------------------------------------------------------------------------------


def test_invocations_answers_as_chat_or_completion_by_the_body(serve):
    status, answer = serve.post("/invocations", {"messages": QUESTION, "max_tokens": 2})
    assert status == 200 and answer["object"] == "chat.completion"
    status, answer = serve.post("/invocations", {"prompt": [1, 5], "max_tokens": 2})
    assert status == 200 and answer["object"] == "text_completion"
    assert "Cannot find suitable handler" in refusal(serve, "/invocations", {"prompt": 123})


# ---- the remaining fields that act --------------------------------------------------------------------------------


def test_weight_versions_ride_on_each_streamed_choices_last_chunk(serve):
    from tests.serve.test_streaming import sse_events

    body = {
        "prompt": [1, 5, 6],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "return_weight_versions": True,
        "ignore_eos": True,
    }
    chunks = [e for e in sse_events(serve.port, "/v1/completions", body) if e != "[DONE]"]
    assert [c["choices"][0]["weight_versions"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 4}]
    chat_chunks = [
        e for e in sse_events(serve.port, "/v1/chat/completions", {"messages": QUESTION, **body}) if e != "[DONE]"
    ]
    assert chat_chunks[-1]["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 4}]
    assert "weight_versions" not in chat_chunks[1]["choices"][0], "only the last chunk of a chat choice carries it"


def test_prompt_token_ids_in_kv_transfer_params_replace_the_rendered_messages(serve):
    ids = [1, 5, 6, 7]
    reused = chat(serve, kv_transfer_params={"prompt_token_ids": ids}, return_token_ids=True)
    assert reused["prompt_token_ids"] == ids
    assert "non-empty list of non-negative integers" in refusal(
        serve, "/v1/chat/completions", {"messages": QUESTION, "kv_transfer_params": {"prompt_token_ids": []}}
    )


def test_seed_minus_one_is_unseeded_and_a_tiny_temperature_is_raised(serve):
    draws = {
        tuple(complete(serve, temperature=1.0, seed=-1, max_tokens=8, return_token_ids=True)["choices"][0]["token_ids"])
        for _ in range(4)
    }
    assert len(draws) > 1, "seed -1 must draw anew each time, as an unseeded request"
    tiny = complete(serve, temperature=0.001, seed=1, logprobs=0)["choices"][0]["logprobs"]["token_logprobs"]
    floor = complete(serve, temperature=0.01, seed=1, logprobs=0)["choices"][0]["logprobs"]["token_logprobs"]
    assert tiny == floor, "a temperature below 0.01 samples as 0.01"


def test_the_generate_routes_own_switches(serve):
    body = {"token_ids": [1, 5, 6], "sampling_params": {"max_tokens": 2, "temperature": 0}}
    status, answer = serve.post("/inference/v1/generate", body)
    assert status == 200 and answer["prompt_token_ids"] is None, "prompt ids only with return_token_ids, as vLLM"
    assert serve.post("/inference/v1/generate", {**body, "return_token_ids": True})[1]["prompt_token_ids"] == [1, 5, 6]
    for change, words in [
        ({"stream": True}, "`stream` is not supported"),
        ({"output_mode": "derender"}, "output_mode='derender' is not supported"),
        ({"output_mode": "text", "sampling_params": {"detokenize": False}}, "requires sampling_params.detokenize"),
        ({"sampling_params": {"trace_decode_token_ids": [1]}}, "--enable-trace-replay"),
    ]:
        assert words in refusal(serve, "/inference/v1/generate", {**body, **change})
    prompt = {"token_ids": list(range(300, 350)), "sampling_params": {"max_tokens": 1}}
    serve.post("/inference/v1/generate", prompt)  # its blocks are cached now
    hits = prefix_hits(serve)
    status, _ = serve.post(
        "/inference/v1/generate", {**prompt, "sampling_params": {"max_tokens": 1, "skip_reading_prefix_cache": True}}
    )
    assert status == 200 and prefix_hits(serve) == hits, "skip_reading_prefix_cache read the cache"
    serve.post("/inference/v1/generate", prompt)
    assert prefix_hits(serve) > hits
