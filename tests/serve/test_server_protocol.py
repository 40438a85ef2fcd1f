"""`tandem serve` against vLLM 0.33's wire contract: fields, types, status codes and error shapes per endpoint."""

import pytest

from tests.conftest import chat_prompt

PROMPT = [1, 274, 205, 277, 275, 227, 25, 29, 279, 227, 26, 30, 37, 2, 205, 1, 271, 205]


def assert_error(status, body, code, type_=None, contains=""):
    assert status == code, f"expected {code}, got {status}: {body}"
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code
    if type_:
        assert body["error"]["type"] == type_
    assert contains in body["error"]["message"], body["error"]["message"]


# ---- /v1/completions ---------------------------------------------------------------------------
def test_completion_with_token_ids_has_vllm_fields(server):
    status, body = server.post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 0, "return_token_ids": True, "seed": 1}
    )
    assert status == 200
    assert set(body) >= {
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "system_fingerprint",
        "kv_transfer_params",
    }
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert set(choice) >= {
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
    }
    assert choice["prompt_token_ids"] == PROMPT
    assert (
        len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"]) == len(choice["logprobs"]["top_logprobs"])
    )
    assert all(len(entry) == 1 for entry in choice["logprobs"]["top_logprobs"]), (
        "logprobs=0 gives only the sampled token"
    )
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])


def test_max_tokens_defaults_to_16(server):
    _, body = server.post("/v1/completions", {"prompt": [1, 5, 6], "ignore_eos": True, "return_token_ids": True})
    assert len(body["choices"][0]["token_ids"]) == 16
    assert body["choices"][0]["finish_reason"] == "length"


def test_max_tokens_is_clamped_to_the_context(server):
    prompt = [5] * 1020  # max_model_len is 1024
    _, body = server.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": 50, "ignore_eos": True, "return_token_ids": True}
    )
    assert len(body["choices"][0]["token_ids"]) == 4


def test_eos_is_in_token_ids_but_not_in_text(server):
    _, body = server.post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "return_token_ids": True, "seed": 3, "temperature": 0.0}
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert choice["token_ids"][-1] == 2
    assert "<|im_end|>" not in choice["text"]


def test_stop_token_id_is_reported_as_an_int(server):
    _, first = server.post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, "return_token_ids": True}
    )
    token = first["choices"][0]["token_ids"][0]
    _, body = server.post(
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, "stop_token_ids": [token], "return_token_ids": True},
    )
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["stop_reason"] == token


def test_stop_string_truncates_text_and_is_the_stop_reason(server):
    _, first = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0})
    text = first["choices"][0]["text"]
    _, body = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, "stop": [text[0]]})
    assert body["choices"][0]["stop_reason"] == text[0] and body["choices"][0]["text"] == ""


def test_top_logprobs_hold_logprobs_plus_one_entries_sampled_first(server):
    _, body = server.post(
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 8,
            "logprobs": 3,
            "seed": 11,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        },
    )
    choice = body["choices"][0]
    for token, lp, entry in zip(
        choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]
    ):
        keys = list(entry)
        assert keys[0] == f"token_id:{token}" and entry[keys[0]] == lp
        assert len(entry) in (3, 4), "k entries when the sampled token is in the top-k, else k+1"


def test_batched_prompts_and_n_index_choices_in_order(server):
    _, body = server.post(
        "/v1/completions", {"prompt": [[1, 5], [1, 6, 7]], "n": 2, "max_tokens": 2, "return_token_ids": True, "seed": 0}
    )
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [[1, 5], [1, 5], [1, 6, 7], [1, 6, 7]]
    assert body["usage"]["prompt_tokens"] == 5


def test_prompt_logprobs_start_with_null(server):
    _, body = server.post("/v1/completions", {"prompt": [1, 274, 205], "max_tokens": 1, "prompt_logprobs": 1})
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 3
    assert "274" in entries[1] and set(entries[1]["274"]) == {"logprob", "rank", "decoded_token"}


def test_echo_returns_the_prompt_as_sent_and_max_tokens_0_the_prompt_alone(server, tokenizer):
    prompt = "Hi <|im_end|> there"
    status, body = server.post("/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 2, "seed": 1})
    choice = body["choices"][0]
    assert status == 200 and choice["text"].startswith(prompt), "the prompt as sent, special tokens included"
    status, body = server.post("/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 0})
    choice = body["choices"][0]
    ids = tokenizer.encode(prompt)
    assert status == 200 and choice["text"] == prompt
    assert (
        choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
        and choice["logprobs"]["token_logprobs"][0] is None
    )
    assert body["usage"]["completion_tokens"] == 1, "vLLM generates one token and returns the prompt alone"
    status, body = server.post("/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 1})
    assert body["choices"][0]["text"].startswith(tokenizer.decode(ids, skip_special_tokens=False)), "ids decoded whole"
    status, body = server.post(
        "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 1, "return_token_ids": True}
    )
    assert not body["choices"][0]["text"].startswith("Hi"), "with token ids returned, vLLM echoes no prompt text"
    status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 0})
    assert_error(status, body, 400, contains="max_tokens must be at least 1, got 0."), "without echo, 0 is refused"


def test_text_prompts_are_tokenized(server):
    status, body = server.post("/v1/completions", {"prompt": "What is 1 + 1?", "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens"] > 3


def test_n_greater_than_one_with_greedy_sampling_is_rejected(server):
    status, body = server.post("/v1/completions", {"prompt": PROMPT, "n": 2, "temperature": 0})
    assert_error(status, body, 400, "BadRequestError", "n must be 1 when using greedy sampling, got 2.")


def test_logprobs_over_the_cap_are_rejected(server):
    status, body = server.post("/v1/completions", {"prompt": PROMPT, "logprobs": 50})
    assert_error(
        status, body, 400, "BadRequestError", "Requested sample logprobs of 50, which is greater than max allowed: 20"
    )
    assert "(parameter=logprobs, value=50)" in body["error"]["message"]


def test_prompt_over_max_model_len_is_rejected(server):
    status, body = server.post("/v1/completions", {"prompt": [5] * 1100})
    assert_error(
        status,
        body,
        400,
        "BadRequestError",
        "This model's maximum context length is 1024 tokens. However, your prompt contains 1100 input tokens",
    )


def test_prompt_exactly_max_model_len_leaves_no_room(server):
    status, body = server.post("/v1/completions", {"prompt": [5] * 1024})
    assert_error(status, body, 400, contains="max_tokens must be at least 1, got 0.")


def test_out_of_vocabulary_and_negative_token_ids(server):
    status, body = server.post("/v1/completions", {"prompt": [1, 99999]})
    assert_error(status, body, 400, contains="Token id 99999 is out of vocabulary")
    status, body = server.post("/v1/completions", {"prompt": [1, -3]})
    assert_error(status, body, 400, "Bad Request", "validation error")


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1),
        ("temperature", 3),
        ("top_p", 0),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("presence_penalty", 3),
        ("max_tokens", 0),
    ],
)
def test_out_of_range_sampling_fields_are_400(server, field, value):
    status, body = server.post("/v1/completions", {"prompt": PROMPT, field: value})
    assert_error(status, body, 400, contains=f"(parameter={field}, value=")


def test_unknown_model_is_404_listing_the_valid_names(server):
    status, body = server.post("/v1/completions", {"prompt": PROMPT, "model": "nope"})
    assert_error(status, body, 404, "NotFoundError", "The model `nope` does not exist. Valid aliases:")
    assert body["error"]["param"] == "model"


def test_unknown_fields_are_ignored(server):
    status, _ = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "not_a_field": 1, "guided_json": {}})
    assert status == 200


def test_bad_json_and_wrong_content_type_are_400(server):
    status, body = server.request("POST", "/v1/completions", raw=b"{not json")
    assert_error(status, body, 400, "Bad Request", "JSON decode error")
    status, body = server.request(
        "POST", "/v1/completions", raw=b'{"prompt": [1]}', headers={"Content-Type": "text/plain"}
    )
    assert_error(status, body, 400, contains="Only 'application/json' is allowed")


def test_missing_prompt_is_a_validation_error(server):
    status, body = server.post("/v1/completions", {"max_tokens": 2})
    assert_error(status, body, 400, "Bad Request", "1 validation error")


# ---- chat, generate, tokenizer ---------------------------------------------------------------------
def test_chat_completion_renders_the_template(server, tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    status, body = server.post(
        "/v1/chat/completions",
        {
            "messages": messages,
            "max_completion_tokens": 6,
            "logprobs": True,
            "top_logprobs": 2,
            "return_token_ids": True,
            "seed": 2,
        },
    )
    assert status == 200 and body["object"] == "chat.completion"
    assert body["prompt_token_ids"] == chat_prompt(tokenizer, "What is 2 + 3?")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"] for c in content)


def test_chat_top_logprobs_without_logprobs_is_400(server):
    status, body = server.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    )
    assert_error(status, body, 400, contains="`logprobs` must be set to true")


def test_generate_returns_integer_token_logprobs(server):
    status, body = server.post(
        "/inference/v1/generate",
        {"token_ids": PROMPT, "sampling_params": {"max_tokens": 5, "logprobs": 1, "seed": 4, "n": 2}},
    )
    assert status == 200 and body["request_id"].startswith("generate-tokens-")
    for choice in body["choices"]:
        entries = choice["logprobs"]["content"]
        assert [e["token_id"] for e in entries] == choice["token_ids"]
        assert all(e["top_logprobs"][0]["token_id"] == e["token_id"] for e in entries)


def test_generate_is_403_without_scale_out(plain_server):
    status, body = plain_server.post("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {}})
    assert_error(status, body, 403, "PermissionDeniedError", "--enable-scale-out")


def test_generate_with_sampling_masks_requires_top_k(mask_server):
    status, body = mask_server.post(
        "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "top_k": 0}}
    )
    assert_error(status, body, 400, contains="requires top_k > 0")
    status, body = mask_server.post("/v1/completions", {"prompt": PROMPT, "temperature": 0, "top_k": 5})
    assert_error(status, body, 400, contains="requires temperature > 0")
    status, body = mask_server.post(
        "/inference/v1/generate",
        {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "top_k": 7, "logprobs": 0, "seed": 1}},
    )
    assert status == 200
    choice = body["choices"][0]
    assert len(choice["sampling_mask"]) == len(choice["token_ids"])
    assert all(
        len(mask) <= 7 and token in mask and mask == sorted(mask)
        for mask, token in zip(choice["sampling_mask"], choice["token_ids"])
    )


def test_tokenize_and_detokenize_round_trip(server, tokenizer):
    status, body = server.post("/tokenize", {"prompt": "What is 12 + 30?", "return_token_strs": True})
    assert status == 200 and body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    _, back = server.post("/detokenize", {"tokens": body["tokens"]})
    assert back["prompt"] == "What is 12 + 30?"
    _, chat = server.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"] == chat_prompt(tokenizer, "hi")


# ---- info, metrics, auth ----------------------------------------------------------------------
def test_health_version_models_server_info_world_size(server):
    assert server.get("/health") == (200, "")
    assert server.get("/version")[1]["version"] == "0.33.0"
    _, models = server.get("/v1/models")
    assert (
        models["object"] == "list"
        and models["data"][0]["max_model_len"] == 1024
        and models["data"][0]["owned_by"] == "vllm"
    )
    _, info = server.get("/server_info", {"config_format": "json"})
    config = info["vllm_config"]
    assert config["model_config"]["dtype"] == "torch.float32"
    assert config["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert config["lora_config"]["max_loras"] == 2
    assert config["parallel_config"]["data_parallel_size"] == 1
    assert server.get("/get_world_size")[1] == {"world_size": 1}


def test_metrics_use_vllm_names_and_labels(server):
    server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    status, text = server.get("/metrics")
    assert status == 200
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert f'{name}{{engine="0",model_name="' in text, name
    assert 'kv_cache_size_tokens="65536"' in text  # 64 sequences x 1024 tokens


def test_api_key_guards_v1_and_the_control_routes_but_not_reads():
    from tests.conftest import ServerThread

    s = ServerThread(api_key="sekret", weight_transfer_config='{"backend": "gloo"}')
    key = {"Authorization": "Bearer sekret"}
    try:
        status, body = s.post("/v1/completions", {"prompt": PROMPT})
        assert status == 401 and body == {"error": "Unauthorized"}
        assert s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, headers=key)[0] == 200
        for path in (
            "/pause",
            "/resume",
            "/reset_prefix_cache",
            "/collective_rpc",
            "/init_weight_transfer_engine",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
        ):
            assert s.post(path, {}) == (401, {"error": "Unauthorized"}), f"{path} must need the key"
        assert s.post("/pause", headers=key)[0] == 200 and s.post("/resume", headers=key)[0] == 200
        for path in ("/health", "/metrics", "/is_paused", "/server_info", "/get_world_size", "/weight_info"):
            assert s.get(path)[0] == 200, f"{path} is a read and stays open"
    finally:
        s.close()


def test_unknown_route_is_a_json_404(server):
    status, body = server.get("/v1/nothing")
    assert_error(status, body, 404)


# ---- dev routes ------------------------------------------------------------------------------------
def test_pause_keep_freezes_and_resume_continues(server):
    import threading

    assert server.request("POST", "/pause?mode=keep") == (200, {"status": "paused"})
    assert server.get("/is_paused")[1] == {"is_paused": True}
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(r=server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3}))
    )
    worker.start()
    worker.join(timeout=0.5)
    assert worker.is_alive(), "a request sent while paused in keep mode waits"
    assert server.request("POST", "/resume") == (200, {"status": "resumed"})
    worker.join(timeout=30)
    assert result["r"][0] == 200


def test_pause_abort_rejects_new_requests_with_503(server):
    assert server.request("POST", "/pause?mode=abort")[0] == 200
    try:
        status, body = server.post("/v1/completions", {"prompt": PROMPT})
        assert_error(
            status, body, 503, "ServiceUnavailableError", "Generation is paused. Please retry after it resumes."
        )
    finally:
        server.request("POST", "/resume")
    assert server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1})[0] == 200


def test_pause_with_an_unknown_mode_is_400(server):
    status, body = server.request("POST", "/pause?mode=sometimes")
    assert status == 400 and "error" in body


def test_reset_prefix_cache_and_collective_rpc_errors(server):
    assert server.post("/reset_prefix_cache")[1] == {"success": True}
    status, body = server.post("/collective_rpc", {})
    assert_error(status, body, 400, contains="Missing 'method' in request body")
    status, body = server.post(
        "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/does/not/exist"}}
    )
    assert_error(status, body, 400, contains="is not a directory")


def test_weight_transfer_routes_say_they_are_not_configured(server):
    status, body = server.post("/init_weight_transfer_engine", {"init_info": {}})
    assert_error(status, body, 500, "InternalServerError", "Weight transfer not configured")


# ---- LoRA errors ---------------------------------------------------------------------------------
def test_lora_errors_follow_vllm(server, plain_server):
    status, body = server.post("/v1/load_lora_adapter", {"lora_name": "x"})
    assert_error(status, body, 400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
    status, body = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp/no-such-adapter"})
    assert_error(status, body, 404, "NotFoundError", "Loading lora x failed: No adapter found for <path>")
    status, body = server.post("/v1/unload_lora_adapter", {"lora_name": "ghost"})
    assert_error(status, body, 404, "NotFoundError", "The lora adapter 'ghost' cannot be found.")
    status, body = server.post("/v1/unload_lora_adapter", {})
    assert_error(status, body, 400, "InvalidUserInput")
    status, body = plain_server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp/x"})
    assert_error(status, body, 500, "InternalServerError", "LoRA is not enabled")


def test_generation_config_supplies_defaults_unless_told_vllm(tmp_path):
    import json
    import shutil

    from tandem.tasks import TINY_MODEL_PATH
    from tests.conftest import ServerThread

    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL_PATH, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 3}))
    for mode, expected in (("auto", 3), ("vllm", 16)):
        s = ServerThread(model_path=str(model), generation_config=mode)
        try:
            _, body = s.post("/v1/completions", {"prompt": PROMPT, "ignore_eos": True, "return_token_ids": True})
            assert len(body["choices"][0]["token_ids"]) == expected, mode
        finally:
            s.close()


def test_a_server_seed_gives_each_prompt_of_a_batch_its_own_seed():
    """`--seed` seeds requests that send none, one draw per prompt: identical prompts in one batch still differ."""
    from tests.conftest import ServerThread

    s = ServerThread(seed=7)
    try:
        status, body = s.post(
            "/v1/completions",
            {
                "prompt": [PROMPT, PROMPT],
                "max_tokens": 16,
                "temperature": 1.0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert status == 200
        first, second = (c["token_ids"] for c in body["choices"])
        assert first != second
    finally:
        s.close()
