"""Shared fixtures: the tiny model, engines over it, and `tandem serve` running in a background thread or process."""

import asyncio
import http.client
import json
import math
import threading
import urllib.parse
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    Qwen2_5_VLConfig,
    Qwen3_5TextConfig,
)

from tandem.errors import COMMAND_VARIABLE
from tandem.generation.launcher import EmbeddedServer
from tandem.kernels import exact_attention
from tandem.serve.app import SERVER_KEY, start_server
from tandem.serve.serve_args import ServeArgs
from tandem.tasks import TINY_MODEL_PATH, scaled_tiny


@pytest.fixture(autouse=True)
def no_run_report(request, monkeypatch):
    """Runs in tests do not draw report.html when they end (2-3 s each), unless the test is marked `report`."""
    if "report" not in request.keywords:
        monkeypatch.setattr("tandem.runtime.session.Session.write_report", lambda session: None)


@pytest.fixture(autouse=True)
def python_api_warnings(monkeypatch):
    """A test that calls the command line's main() in this process leaves no trace on the next: the command line's
    warning format (warnings.showwarning, and TANDEM_COMMAND, which the rollout workers it starts read) is undone."""
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setenv(COMMAND_VARIABLE, "")  # recorded first, so that teardown removes one a test set, too
    monkeypatch.delenv(COMMAND_VARIABLE)


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_PATH)


def tiny_hybrid() -> torch.nn.Module:
    """A Qwen3.5-style hybrid over the tiny tokenizer's vocabulary: two gated DeltaNet layers, then full attention."""
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        max_position_embeddings=1024,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_vlm() -> torch.nn.Module:
    """A Qwen2.5-VL-style vision-language model over the tiny tokenizer's vocabulary, with a one-block vision tower."""
    torch.manual_seed(0)
    text = dict(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, fullatt_block_indexes=[0]
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
    )
    return AutoModelForImageTextToText.from_config(config).eval()


def tiny_wide() -> torch.nn.Module:
    """The tiny model's architecture twice as wide (hidden 384, 2 layers), random weights: its head and all but its key
    and value projections reach onednn_linear.MIN_ELEMENTS, so on an x86 CPU they compute on oneDNN."""
    return scaled_tiny(384, 2).eval()


def saved_with_tiny_tokenizer(model: torch.nn.Module, folder) -> str:
    """`model` saved to `folder` with the tiny model's tokenizer and chat template: a checkpoint trainer and server load."""
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_MODEL_PATH).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def wide_path(tmp_path_factory) -> str:
    return saved_with_tiny_tokenizer(tiny_wide(), tmp_path_factory.mktemp("wide"))


@pytest.fixture(scope="session")
def vlm_path(tmp_path_factory) -> str:
    return saved_with_tiny_tokenizer(tiny_vlm(), tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="session")
def tiny_model():
    """The shipped tiny model in fp32 with the trainer's exact attention, for teacher-forced reference forwards (never
    mutated)."""
    model = AutoModelForCausalLM.from_pretrained(
        TINY_MODEL_PATH, dtype=torch.float32, attn_implementation=exact_attention.NAME
    )
    return model.eval()


class HttpCalls:
    """Plain HTTP calls to a server on 127.0.0.1:`port`, each answered as (status, parsed JSON or text)."""

    port: int

    def request(self, method: str, path: str, body=None, *, raw: bytes | None = None, headers=None):
        """A plain HTTP call; returns (status, parsed JSON or text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(headers or {})
        conn.request(method, path, body=data, headers=hdrs)
        response = conn.getresponse()
        text = response.read().decode()
        conn.close()
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text

    def post(self, path, body=None, **kw):
        return self.request("POST", path, body, **kw)

    def get(self, path, params=None, **kw):
        return self.request("GET", path + ("?" + urllib.parse.urlencode(params) if params else ""), **kw)


class ServerThread(HttpCalls):
    """`tandem serve` in a thread with its own event loop; `url` is ready when the constructor returns."""

    def __init__(self, model_path: str = TINY_MODEL_PATH, **kwargs):
        self.args = ServeArgs(model=model_path, port=0, **kwargs)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.runner, self.port = self.loop.run_until_complete(start_server(self.args))
            started.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self.runner.cleanup())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(60), "tandem serve did not start within 60s"
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def server(self):
        return self.runner.app[SERVER_KEY]

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


STREAMED_REPLICA = [
    "--served-model-name",
    TINY_MODEL_PATH,
    "--logprobs-mode",
    "processed_logprobs",
    "--max-logprobs",
    "20",
    "--weight-transfer-config",
    '{"backend": "gloo"}',
    "--weight-transfer-timeout-s",
    "30",
]
"""`tandem serve` flags of a tiny-model replica behind tandem proxy that takes the trainer's weights over the gloo
stream (a failed transfer gives up after 30 s)."""


class ServeProcess(HttpCalls):
    """`tandem serve tiny FLAGS...` as its own process, what users run; `process` is the launcher's ServerProcess."""

    def __init__(self, *flags: str):
        self.process = EmbeddedServer("tiny", extra_args=list(flags), startup_timeout_s=120, shares_cores=False)
        self.url = self.process.url
        self.port = int(self.url.rsplit(":", 1)[1])

    def close(self):
        self.process.stop()


@pytest.fixture(scope="session")
def server():
    """Processed log-probs, scale-out and LoRA on: what the trainer runs against."""
    s = ServerThread(
        logprobs_mode="processed_logprobs",
        enable_scale_out=True,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
        max_num_seqs=64,
        max_logprobs=20,
    )
    yield s
    s.close()


@pytest.fixture(scope="session")
def plain_server():
    """`vllm serve`'s defaults: raw log-probs, no scale-out, no LoRA."""
    s = ServerThread()
    yield s
    s.close()


@pytest.fixture(scope="session")
def mask_server():
    s = ServerThread(logprobs_mode="processed_logprobs", enable_scale_out=True, return_sampling_mask=True)
    yield s
    s.close()


def probe_gap(run: asyncio.Runner, client, served_name: str, model, prompt: list[int]):
    """The sync probe's gap (SyncGap) between what `served_name` serves for a fresh seeded completion of `prompt` and
    `model`'s own log-probs of it."""
    from tandem.runtime import sync_check

    probe = sync_check.SyncProbe(
        prompt, "float32", SimpleNamespace(weight_sync_check_atol=math.inf, vllm_server_base_url=None)
    )
    completion, served = run.run(probe.served_logprobs(client, served_name))
    return probe.judge(served_name, served, sync_check.policy_log_probs(model, prompt, completion, "exact"))


def chat_prompt(tokenizer, question: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
