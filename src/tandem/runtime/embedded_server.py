"""The `tandem serve` a run starts for itself when no vllm_server_base_url is given: the folder it loads, and its flags."""

import json
import time
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.config import AsyncGRPOConfig
from tandem.contract.algorithms import algorithm_of
from tandem.model.distributed import Ranks
from tandem.model.model_folder import save_model_folder
from tandem.runtime.weight_sync import lora_server_flags

SERVER_RESTARTS = 3
SERVER_RESTART_WINDOW_S = 600.0
"""The embedded server is restarted when it dies, unless it died SERVER_RESTARTS times in the last 10 minutes."""


@dataclass
class Restarts:
    """When the embedded server was restarted (monotonic seconds): one that keeps dying stops the run."""

    times: list[float] = field(default_factory=list)

    def allowed(self) -> bool:
        """Fewer than SERVER_RESTARTS restarts in the last SERVER_RESTART_WINDOW_S."""
        now = time.monotonic()
        self.times = [t for t in self.times if now - t < SERVER_RESTART_WINDOW_S]
        return len(self.times) < SERVER_RESTARTS

    def note(self) -> None:
        self.times.append(time.monotonic())


def served_folder(model_name: str, model: torch.nn.Module, tokenizer, output_dir: Path, ranks: Ranks) -> str:
    """A folder with exactly the trainer's weights: the model's own, or a copy saved under `output_dir`."""
    if Path(model_name).is_dir():
        return model_name
    folder = output_dir / ".weights" / "initial"
    save_model_folder(model, folder, ranks)
    if ranks.main:
        tokenizer.save_pretrained(folder)
    return str(folder)


def server_flags(args: AsyncGRPOConfig, model_name: str, served_dtype: str, lora_rank: int | None) -> list[str]:
    """The server's command-line flags: the trainer's name for the model, its log-probs and dtype, its sampling masks
    when top-k / top-p truncate, and the way weights reach it (a gloo stream, or LoRA adapters)."""
    flags = [
        "--served-model-name",
        model_name,
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        str(max(20, algorithm_of(args).sampler_top_logprobs(args))),
        "--dtype",
        served_dtype,
        "--max-num-seqs",
        str(min(256, args.max_concurrent_rollouts)),
    ]
    if args.uses_truncated_sampling:  # each token's kept set, to renormalise the trainer's log-probs over it
        flags += ["--enable-scale-out", "--return-sampling-mask"]
    if lora_rank is not None:
        flags += lora_server_flags(args.staleness_policy, lora_rank)
    else:  # full weights stream over a gloo group: faster than the reload (benchmarks/weight_sync.py)
        flags += [
            "--weight-transfer-config",
            json.dumps({"backend": "gloo"}),
            "--weight-transfer-timeout-s",
            str(args.vllm_server_timeout),
        ]
    if args.recompute_kv_cache_after_weight_updates:
        flags += ["--recompute-kv-cache-after-weight-updates"]
    if args.embedded_server_host != "127.0.0.1":
        flags += ["--host", args.embedded_server_host]
    if args.vllm_server_api_key:
        flags += ["--api-key", args.vllm_server_api_key]
    if args.trust_remote_code:
        flags += ["--trust-remote-code"]
    return flags


VLLM_DEFAULT_URL = "http://127.0.0.1:8000"
"""Where `vllm serve` listens unless told otherwise: a server a user started as vLLM's quick start says."""


def warn_if_a_server_waits(timeout_s: float = 0.5) -> None:
    """A run without vllm_server_base_url starts its own server; one that answers at vLLM's default address was most
    likely meant to be used instead, so say how (half a second at most, and nothing when none answers)."""
    url = VLLM_DEFAULT_URL
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as answer:
            if answer.status != 200:
                return
    except (OSError, ValueError):
        return
    warnings.warn(
        f"a generation server answers at {url} (vllm serve's default address), but vllm_server_base_url is "
        "not set, so this run starts its own embedded tandem serve. To generate from that server, set "
        f"vllm_server_base_url={url} (or, as in TRL, vllm_server_port=8000).",
        stacklevel=2,
    )
