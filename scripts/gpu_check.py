"""The checks that need a GPU, for the day one is at hand: one command, under 4 minutes on one GPU, installing nothing.

    python scripts/gpu_check.py                 # on a machine with a CUDA torch, transformers, peft and tandem
    python scripts/gpu_check.py --device cpu    # the same checks on a CPU, to rehearse the script itself

One line per check: `ok`, `FAIL` (with the numbers), or `skipped: <why>`. Exit code 1 when any check failed.
  1. tandem serve on the device in bf16: a completion of the tiny model, its tokens/s;
  2. the `flex` tree kernel: a packed row's log-probs against each sample's own forward (bf16 on CUDA);
  3. a short training run on the embedded server at staleness 0: the importance ratio, MFU;
  4. an in-flight sync into bf16 `tandem serve` (its cache recomputed): a long generation with a weight update in its
     middle, each token's served log-prob against the forward of the weights that sampled it;
  5. vLLM's NCCL weight transfer into `vllm serve`: not run here (it needs vLLM built for CUDA beside the trainer).
"""

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))  # tandem from this checkout, installed or not
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))  # and its servers'

import torch  # noqa: E402

import tandem.trainer  # noqa: E402,F401 - before torch: its OpenMP threads wait passively (the server runs beside)

NEEDS = {
    "tandem serve (bf16)": ["transformers", "aiohttp", "pydantic", "safetensors"],
    "flex kernel: packed = unpacked": ["transformers"],
    "training at staleness 0": ["transformers", "peft", "datasets", "aiohttp", "pydantic", "math_verify", "rich"],
    "in-flight sync, per token": ["transformers", "aiohttp", "pydantic", "safetensors"],
}
"""What each check imports beyond torch: a machine without one says `skipped: <package> absent` for that check."""


def line(name: str, verdict: str) -> None:
    print(f"{name:<32} {verdict}", flush=True)


@contextlib.contextmanager
def served(device: str, dtype: str, *flags: str):
    """`tandem serve tiny` on `device` in `dtype`, its URL once it answers /health; its log tail on a failure."""
    from tandem.runtime.weight_transfer import free_port

    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "tandem", "serve", "tiny", "--port", str(port), "--device", device]
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen([*command, "--dtype", dtype, *flags], stdout=log, stderr=subprocess.STDOUT)
        try:
            url, end = f"http://127.0.0.1:{port}", time.monotonic() + 120
            while time.monotonic() < end:
                try:
                    urllib.request.urlopen(url + "/health", timeout=2)
                    break
                except OSError:
                    time.sleep(0.5)
            yield url
        except Exception as exc:
            log.seek(0)
            raise RuntimeError(f"{exc!r}; server log tail: {log.read().decode(errors='replace')[-600:]!r}") from exc
        finally:
            server.kill()
            server.wait()


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


def check_serve(device: str) -> bool:
    """tandem serve on `device` in bf16 answers a completion; returns whether it did."""
    with served(device, "bfloat16") as url:
        body = {"prompt": [1, 40, 41, 42], "max_tokens": 64, "n": 16, "ignore_eos": True, "seed": 0, "logprobs": 0}
        start = time.perf_counter()
        answer = post(url + "/v1/completions", body)
        seconds = time.perf_counter() - start
        tokens = answer["usage"]["completion_tokens"]
        dtype = json.loads(urllib.request.urlopen(url + "/server_info?config_format=json").read())["vllm_config"]
    line(
        "tandem serve (bf16)",
        f"ok: {tokens} tokens in {seconds:.2f}s ({tokens / seconds:.0f} tok/s), "
        f"dtype {dtype['model_config']['dtype']} on {dtype['device_config']['device']}",
    )
    return True


def check_in_flight(device: str) -> bool:
    """A 120-token generation on `tandem serve --recompute-kv-cache-after-weight-updates` (bf16 on CUDA) with a weight
    update streamed in its middle: every token's served log-prob against the forward, on the same device and dtype,
    of the weights its span names."""
    import asyncio
    import concurrent.futures

    from transformers import AutoModelForCausalLM

    from tandem.generation.client import ControlClient
    from tandem.runtime.weight_transfer import TransferSync
    from tandem.tasks import TINY_MODEL_PATH

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    name = str(dtype).removeprefix("torch.")
    mean_bound, max_bound = (0.06, 0.5) if dtype == torch.bfloat16 else (1e-5, 1e-4)  # bf16 rounding, as the doctor's
    first = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=dtype).to(device).eval()
    pushed = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=dtype).to(device).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in pushed.parameters():
            p.add_(0.01 * torch.randn_like(p))
    flags = ["--weight-transfer-config", '{"backend": "gloo"}', "--step-delay-s", "0.02"]
    prompt = [1, 40, 41, 42]
    body = {"prompt": prompt, "max_tokens": 120, "ignore_eos": True, "seed": 0, "logprobs": 0}
    body |= {"return_token_ids": True, "return_weight_versions": True}
    with served(device, name, *flags, "--recompute-kv-cache-after-weight-updates") as url:
        with asyncio.Runner() as run, concurrent.futures.ThreadPoolExecutor(1) as pool:
            control = ControlClient(url)
            sync = TransferSync(control, run, "tiny", timeout_s=60)
            sync.connect()
            answer = pool.submit(post, url + "/v1/completions", body)
            time.sleep(1.0)  # about 50 of the 120 steps
            sync.push(pushed, 1)
            choice = answer.result()["choices"][0]
            run.run(control.close())
    output, spans = choice["token_ids"], choice["weight_versions"]
    if len(spans) != 2:
        line("in-flight sync, per token", f"FAIL: the update did not land in the generation's middle: spans {spans}")
        return False
    cut = spans[0]["end"]

    def log_probs(model) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output], device=device)).logits[0, len(prompt) - 1 : -1]
        return logits.float().log_softmax(-1).gather(1, torch.tensor(output, device=device)[:, None])[:, 0].cpu()

    expected = torch.cat([log_probs(first)[:cut], log_probs(pushed)[cut:]])
    gaps = (torch.tensor(choice["logprobs"]["token_logprobs"]) - expected).abs()
    verdict = "ok" if gaps.mean() <= mean_bound and gaps.max() <= max_bound else "FAIL"
    line(
        "in-flight sync, per token",
        f"{verdict}: update at token {cut} of {len(output)}; |served - forward of its version| mean "
        f"{gaps.mean():.2e}, max {gaps.max():.2e} ({name}, allowed {mean_bound:g} / {max_bound:g})",
    )
    return verdict == "ok"


def check_flex(device: str) -> bool:
    """A packed row of three samples (two sharing a prompt) through the flex kernel against each one alone."""
    from transformers import AutoModelForCausalLM

    from tandem.contract.records import Sample
    from tandem.packing import pack, tree_attention
    from tandem.packing.log_probs import row_log_probs
    from tandem.tasks import TINY_MODEL_PATH

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-4  # bf16: one rounding of a log-prob near -10 is 0.03
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 380, (40,), generator=generator).tolist()
    seqs = [prompt + torch.randint(3, 380, (n,), generator=generator).tolist() for n in (12, 20)]
    seqs.append(torch.randint(3, 380, (30,), generator=generator).tolist())
    samples = [
        Sample(
            input_ids=s,
            trained=[False] * (len(s) - 10) + [True] * 10,
            behavior_log_probs=[0.0] * len(s),
            advantage=1.0,
            model_version=0,
            group_id=i,
            prompt_index=i,
            group_samples=1,
            rollout_id=str(i),
            created_at=0.0,
        )
        for i, s in enumerate(seqs)
    ]
    reference = (
        AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    )
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=dtype).to(device).eval()
    tree_attention.prepare(model)
    with torch.no_grad():
        got = row_log_probs(model, pack(samples), "flex").log_probs.float().cpu()
        expected = []
        for s in samples:
            logits = reference(input_ids=torch.tensor([s.input_ids], device=device)).logits[0].float().log_softmax(-1)
            expected += [logits[j - 1, s.input_ids[j]].item() for j in range(1, len(s.input_ids)) if s.trained[j]]
    gap = (got - torch.tensor(expected)).abs().max().item()
    verdict = "ok" if gap <= tolerance else "FAIL"
    line(
        "flex kernel: packed = unpacked",
        f"{verdict}: max |log-prob gap| {gap:.2e} over {len(expected)} tokens "
        f"({str(dtype).removeprefix('torch.')}, allowed {tolerance:g})",
    )
    return gap <= tolerance


def check_training(device: str) -> bool:
    """Ten steps of the demo's task on the embedded server at staleness 0."""
    from datasets import Dataset

    from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
    from tandem.rewards import accuracy_reward
    from tandem.tasks import arithmetic

    with tempfile.TemporaryDirectory() as out:
        args = AsyncGRPOConfig(
            output_dir=out,
            max_steps=10,
            max_staleness=0,
            learning_rate=2e-4,
            num_generations=8,
            max_completion_length=8,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            use_cpu=device == "cpu",
        )
        trainer = AsyncGRPOTrainer(
            "tiny", accuracy_reward, args=args, train_dataset=Dataset.from_list(arithmetic.make_rows(128))
        )
        trainer.train()
        rows = [json.loads(r) for r in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    ratios = [
        r["sampling/importance_sampling_ratio/mean"] for r in rows if "sampling/importance_sampling_ratio/mean" in r
    ]
    mfu = [r["perf/fwd_bwd_mfu"] for r in rows if "perf/fwd_bwd_mfu" in r]
    worst = max(abs(r - 1) for r in ratios)
    tolerance = 1e-2 if device == "cuda" else 1e-4  # bf16 on both sides against fp32
    verdict = "ok" if len(ratios) == 10 and worst <= tolerance else "FAIL"
    line(
        "training at staleness 0",
        f"{verdict}: {len(ratios)} steps, |ratio - 1| <= {worst:.2e} (allowed {tolerance:g}), "
        f"fwd_bwd MFU {sum(mfu) / len(mfu):.3f}"
        if mfu
        else f"{verdict}: {len(ratios)} steps, |ratio - 1| <= {worst:.2e} (allowed {tolerance:g}), MFU not measured on {device}",
    )
    return verdict == "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    device = parser.parse_args().device
    if device == "cuda" and not torch.cuda.is_available():
        line("all checks", "skipped: torch sees no CUDA device (rehearse with --device cpu)")
        return
    results = []
    for name, check in [
        ("tandem serve (bf16)", check_serve),
        ("flex kernel: packed = unpacked", check_flex),
        ("training at staleness 0", check_training),
        ("in-flight sync, per token", check_in_flight),
    ]:
        absent = [module for module in NEEDS[name] if importlib.util.find_spec(module) is None]
        if absent:
            line(name, f"skipped: {absent[0]} absent")
            continue
        try:
            results.append(check(device))
        except Exception as exc:  # noqa: BLE001 - one check's failure must not cost the others their device time
            line(name, f"FAIL: {exc!r}")
            results.append(False)
    try:
        import vllm  # noqa: F401

        line(
            "NCCL transfer into vllm serve", "not run: this script starts no vllm serve (tests/vllm runs the CPU build)"
        )
    except ImportError:
        line("NCCL transfer into vllm serve", "skipped: vllm absent")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
