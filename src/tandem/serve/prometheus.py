"""`/metrics`: the engine's counters in the Prometheus text format, under vLLM's metric names and labels."""

from collections.abc import Sequence

from tandem.serve.prefix_cache import BLOCK_SIZE
from tandem.serve.requests import EngineStats

COUNTERS = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", "running"),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "waiting"),
    ("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", "preemptions_total"),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", "prompt_tokens_total"),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", "generation_tokens_total"),
    (
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_cache_queries_total",
    ),
    (
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        "prefix_cache_hits_total",
    ),
)
"""vLLM's metrics that are one engine counter each: name, Prometheus type, vLLM's help text, EngineStats' field."""


def metric(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float]], labels: str) -> list[str]:
    """One metric's lines: its help, its type, and a sample per (extra labels, value)."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"] + [
        f"{name}{{{extra}{labels}}} {float(value)}" for extra, value in samples
    ]


def prometheus_text(stats: EngineStats, model_name: str, prefix_caching: bool) -> str:
    """The `/metrics` exposition with vLLM's names and labels."""
    labels = f'engine="0",model_name="{model_name}"'
    usage = stats.kv_used_tokens / stats.kv_capacity_tokens if stats.kv_capacity_tokens else 0.0
    lines = metric(
        "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", [("", usage)], labels
    )
    for name, kind, help_text, field in COUNTERS:
        lines += metric(name, kind, help_text, [("", getattr(stats, field))], labels)
    finished = [(f'finished_reason="{reason}",', count) for reason, count in sorted(stats.finished_total.items())]
    lines += metric(
        "vllm:request_success_total", "counter", "Count of successfully processed requests.", finished, labels
    )
    info = (
        f'block_size="{BLOCK_SIZE}",enable_prefix_caching="{prefix_caching}",'
        f'kv_cache_size_tokens="{stats.kv_capacity_tokens}",num_gpu_blocks="{stats.kv_capacity_tokens // BLOCK_SIZE}",'
    )  # vLLM labels its config info by engine alone
    lines += metric(
        "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", [(info, 1)], 'engine="0"'
    )
    return "\n".join(lines) + "\n"
