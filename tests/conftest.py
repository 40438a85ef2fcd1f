"""Shared fixtures: the tiny model, engines over it, and `tandem serve` running in a background thread."""

import asyncio
import http.client
import json
import threading
import urllib.parse

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.generation.server import SERVER_KEY, ServeArgs, start_server
from tandem.tasks import TINY_MODEL_PATH


@pytest.fixture(autouse=True)
def no_run_report(request, monkeypatch):
    """Runs in tests do not draw report.html when they end (2-3 s each), unless the test is marked `report`."""
    if "report" not in request.keywords:
        monkeypatch.setattr("tandem.trainer.session.Session.write_report", lambda session: None)


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_PATH)


@pytest.fixture(scope="session")
def tiny_model():
    """The shipped tiny model in fp32, for teacher-forced reference forwards (never mutated)."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


class ServerThread:
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


@pytest.fixture(scope="session")
def server():
    """Processed log-probs, scale-out and LoRA on: what the trainer runs against."""
    s = ServerThread(logprobs_mode="processed_logprobs", enable_scale_out=True, enable_lora=True, max_loras=2,
                     max_cpu_loras=3, max_num_seqs=64, max_logprobs=20)
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


def chat_prompt(tokenizer, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))
