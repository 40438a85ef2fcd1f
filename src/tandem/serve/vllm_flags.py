"""`vllm serve`'s flags (vLLM 0.33) that `tandem serve` does not take, and why: a recipe or script written for
vLLM gets one line naming the flag and what to do, never "unrecognized arguments" nor a flag accepted and ignored.

The flags `tandem serve` implements are its own argparse options (tandem.cli); `ALREADY_SO` are the flags whose
promise tandem serve keeps without being asked (`--enforce-eager`: it always runs eagerly), taken as they are.
"""

ENGINE_TUNING = frozenset(
    """
additional-config aggregate-engine-logging all2all-backend allow-deprecated-quantization api-server-count
async-scheduling attention-backend attention-config block-size collect-detailed-traces compilation-config config
cp-kv-cache-interleave-size cpu-distributed-timeout-seconds cpu-offload-gb cpu-offload-params
cudagraph-capture-sizes cudagraph-metrics custom-histogram-buckets data-parallel-address data-parallel-backend
data-parallel-external-lb data-parallel-hybrid-lb data-parallel-multi-port-external-lb data-parallel-rank
data-parallel-rpc-port data-parallel-size data-parallel-size-local data-parallel-start-rank
data-parallel-supervisor-port dbo-decode-token-threshold dbo-prefill-token-threshold dcp-comm-backend
dcp-kv-cache-interleave-size dcp-q-replicate decode-context-parallel-size device-ids device-memory-utilization
disable-access-log-for-endpoints disable-batch-sharded-sampling disable-cascade-attn disable-chunked-mm-input
disable-chunked-prefill disable-cumem-allocator disable-custom-all-reduce disable-dbo disable-elastic-ep
disable-ep-weight-filter disable-eplb disable-expert-parallel disable-fault-tolerance
disable-flash-late-interaction disable-flashinfer-autotune disable-hc-sp disable-hybrid-kv-cache-manager
disable-layerwise-nvtx-tracing disable-log-deltas disable-log-outputs disable-log-requests disable-log-stats
disable-logging-iteration-details disable-mamba-cache-stochastic-rounding disable-mamba-shared-prefix-checkpoint
disable-mfu-metrics disable-mixed-moe-lora-format disable-moe-shared-loras disable-nccl-comm-suspend
disable-nccl-for-dp-synchronization disable-prefix-caching disable-shm-tensor-arena disable-sleep-mode
disable-ssl-refresh disable-uvicorn-access-log distributed-executor-backend distributed-timeout-seconds
download-dir dp-supervisor-probe-failure-threshold dp-supervisor-probe-interval-s dp-supervisor-probe-timeout-s
dp-sync-interval ec-manager-config ec-transfer-config elastic-ep-max-dp-size enable-batch-sharded-sampling
enable-cascade-attn enable-chunked-mm-input enable-chunked-prefill enable-cumem-allocator
enable-custom-all-reduce enable-dbo enable-elastic-ep enable-ep-weight-filter enable-eplb enable-expert-parallel
enable-fault-tolerance enable-flash-late-interaction enable-flashinfer-autotune enable-hc-sp
enable-hybrid-kv-cache-manager enable-layerwise-nvtx-tracing enable-log-deltas enable-log-outputs
enable-log-requests enable-logging-iteration-details enable-mamba-cache-stochastic-rounding
enable-mamba-shared-prefix-checkpoint enable-mfu-metrics enable-mixed-moe-lora-format enable-moe-shared-loras
enable-nccl-comm-suspend enable-nccl-for-dp-synchronization enable-prefix-caching enable-shm-tensor-arena
enable-sleep-mode enable-ssl-refresh enable-uvicorn-access-log enforce-eager engram-config eplb-config
expert-placement-strategy fail-on-environ-validation fault-tolerance-config fully-sharded-loras
gdn-prefill-backend gpu-memory-utilization grpc grpc-port headless help hf-token host ignore-patterns
ir-op-priority jit-monitor-mode jit-monitor-verbose kda-decode-backend kda-prefill-backend kernel-config
kv-cache-dtype-skip-layers kv-cache-memory-bytes kv-cache-metrics kv-cache-metrics-sample kv-events-config
kv-offloading-backend kv-offloading-size kv-sharing-fast-prefill kv-transfer-config linear-backend
log-config-file log-error-stack log-level logging-config long-prefill-token-threshold
long-prefill-token-threshold-adaptive lora-dtype mamba-backend mamba-block-size mamba-cache-dtype
mamba-cache-mode mamba-cache-philox-rounds mamba-ssm-cache-dtype mamba-ssu-algorithm master-addr master-port
max-cpu-loras max-cudagraph-capture-size max-log-len max-loras max-num-active-seqs max-num-batched-tokens
max-num-scheduled-tokens max-num-seqs max-parallel-loading-workers mm-device-do-normalize
mm-encoder-attn-backend mm-encoder-attn-dtype mm-encoder-fp8-scale-path mm-encoder-fp8-scale-save-margin
mm-encoder-fp8-scale-save-path mm-encoder-only mm-encoder-tp-mode mm-hasher-algorithm mm-ipc-gpu-memory-gb
mm-processor-cache-gb mm-processor-cache-type mm-processor-device mm-shm-cache-max-object-size-mb mm-tensor-ipc
model-loader-extra-config moe-backend monokernel nnodes no-allow-deprecated-quantization no-async-scheduling
no-cudagraph-metrics no-data-parallel-external-lb no-data-parallel-hybrid-lb no-dcp-q-replicate
no-disable-cascade-attn no-disable-chunked-mm-input no-disable-custom-all-reduce
no-disable-hybrid-kv-cache-manager no-disable-nccl-for-dp-synchronization no-disable-uvicorn-access-log
no-enable-batch-sharded-sampling no-enable-chunked-prefill no-enable-cumem-allocator no-enable-dbo
no-enable-elastic-ep no-enable-ep-weight-filter no-enable-eplb no-enable-expert-parallel
no-enable-fault-tolerance no-enable-flash-late-interaction no-enable-flashinfer-autotune no-enable-hc-sp
no-enable-layerwise-nvtx-tracing no-enable-log-deltas no-enable-log-outputs no-enable-log-requests
no-enable-logging-iteration-details no-enable-mamba-cache-stochastic-rounding
no-enable-mamba-shared-prefix-checkpoint no-enable-mfu-metrics no-enable-mixed-moe-lora-format
no-enable-moe-shared-loras no-enable-nccl-comm-suspend no-enable-prefix-caching no-enable-shm-tensor-arena
no-enable-sleep-mode no-enable-ssl-refresh no-enforce-eager no-fail-on-environ-validation no-fully-sharded-loras
no-jit-monitor-verbose no-kv-cache-metrics no-kv-sharing-fast-prefill no-log-error-stack
no-long-prefill-token-threshold-adaptive no-mm-device-do-normalize no-mm-encoder-only no-monokernel no-numa-bind
no-ray-workers-use-nsight no-scheduler-reserve-full-isl no-skip-mm-profiling no-sleep-mode-offload-cudagraph
no-specialize-active-lora no-swa-bounded-replay no-use-replayssm no-use-tqdm-on-load node-rank
num-gpu-blocks-override numa-bind numa-bind-cpus numa-bind-nodes offload-backend offload-group-size
offload-num-in-group offload-params offload-prefetch-step optimization-level otlp-traces-endpoint
performance-mode pipeline-parallel-size port prefill-context-parallel-size prefill-schedule-interval
prefix-cache-retention-interval prefix-caching-hash-algo prefix-match-unit profiler-config pt-load-map-location
ray-workers-use-nsight renderer-num-workers replayssm-buffer-len safetensors-load-strategy
safetensors-prefetch-block-size safetensors-prefetch-num-threads scheduler-cls scheduler-reserve-full-isl
show-hidden-metrics-for-version shutdown-timeout skip-mm-profiling sleep-mode-backend
sleep-mode-offload-cudagraph sleep-preserve-parameter-names sparse-indexer-topk-backend spec-method spec-model
spec-tokens specialize-active-lora speculative-config ssl-ca-certs ssl-cert-reqs ssl-certfile ssl-ciphers
ssl-keyfile swa-bounded-replay tensor-parallel-size ubatch-size uds use-replayssm use-tqdm-on-load
uvicorn-log-level watchdog-config watermark weight-transfer-config worker-cls worker-extension-cls
""".split()
)
"""vLLM's flags that tune its engine (parallelism, memory, kernels, compilation, logging, transport): tandem serve has
none of these parts; one line says so."""

NO_MEDIA = "tandem serve serves text only (a vision-language model's language model)"
NO_REASONING = "tandem serve has no reasoning parsers: a reply's reasoning stays in its content"
LOCAL_ONLY = "tandem serve loads the model folder as it is on disk: check out that revision into a folder instead"
NO_ROUTE = "tandem serve has no such route"
NO_GUIDED = "structured outputs (guided decoding) are not implemented by tandem serve"
CORS = "tandem serve sends no CORS headers: put it behind a proxy that adds them"

REFUSED = {
    "allow-credentials": CORS,
    "allowed-headers": CORS,
    "allowed-methods": CORS,
    "allowed-origins": CORS,
    "anthropic-disabled-thinking-effort": "tandem serve has no Anthropic messages route",
    "cohere-format": NO_ROUTE,
    "cohere-is-reasoning-model": NO_ROUTE,
    "enable-offline-docs": "tandem serve has no /docs page",
    "enable-fastapi-docs": "tandem serve has no /docs page",
    "no-disable-fastapi-docs": "tandem serve has no /docs page",
    "enable-per-request-metrics": "tandem serve does not time each request: read /metrics",
    "h11-max-header-count": "tandem serve runs on aiohttp, not uvicorn's h11",
    "h11-max-incomplete-event-size": "tandem serve runs on aiohttp, not uvicorn's h11",
    "middleware": "tandem serve runs on aiohttp, which takes no ASGI middleware",
    "root-path": "tandem serve serves at /: strip the prefix in the proxy in front of it",
    "sse-keep-alive-interval": "tandem serve sends no keep-alive comments in its streams",
    "tokens-only": "tandem serve always loads its tokenizer: use --enable-scale-out for the token routes",
    "tool-parser-plugin": "tandem serve's tool-call formats are built in (--tool-call-parser)",
    "tool-server": "tandem serve has no Responses API",
    "tool-strict-level": NO_GUIDED,
    "trust-request-mm-kwargs": NO_MEDIA,
    "no-language-model-only": NO_MEDIA,
    "allowed-local-media-path": NO_MEDIA,
    "allowed-media-domains": NO_MEDIA,
    "code-revision": LOCAL_ONLY,
    "revision": LOCAL_ONLY,
    "tokenizer-revision": LOCAL_ONLY,
    "hf-config-path": "tandem serve reads config.json from the model folder",
    "config-format": "tandem serve reads Hugging Face configs (config.json)",
    "convert": "tandem serve generates text; it does not pool or classify",
    "runner": "tandem serve generates text; it does not pool or classify",
    "pooler-config": "tandem serve generates text; it does not pool or classify",
    "io-processor-plugin": "tandem serve generates text; it does not pool or classify",
    "disable-sliding-window": "tandem serve runs the model's attention as transformers defines it",
    "enable-prompt-embeds": "tandem serve takes token ids or text",
    "enable-return-routed-experts": "tandem serve does not report MoE routing",
    "enable-trace-replay": "tandem serve does not replay traces",
    "hf-overrides": "edit the model folder's config.json instead",
    "logits-processors": "tandem serve has no logits-processor plugins",
    "model": "give the model as the first argument: tandem serve MODEL",
    "model-class-overrides": "tandem serve loads the class config.json names",
    "model-impl": "tandem serve runs transformers' implementation",
    "quantization": "tandem serve does not quantize",
    "quantization-config": "tandem serve does not quantize",
    "skip-tokenizer-init": "tandem serve always loads its tokenizer",
    "tokenizer-mode": "tandem serve uses the Hugging Face tokenizer",
    "use-fp64-gumbel": "tandem serve samples by inverse CDF from each request's own generator",
    "load-format": "tandem serve loads safetensors or PyTorch weights as transformers does",
    "reasoning-parser": NO_REASONING,
    "reasoning-parser-plugin": NO_REASONING,
    "reasoning-config": NO_REASONING,
    "kv-cache-dtype": "tandem serve keeps the KV cache in the model's dtype",
    "enable-mm-embeds": NO_MEDIA,
    "interleave-mm-strings": NO_MEDIA,
    "limit-mm-per-prompt": NO_MEDIA,
    "media-io-kwargs": NO_MEDIA,
    "mm-processor-kwargs": NO_MEDIA,
    "video-pruning-method": NO_MEDIA,
    "video-pruning-rate": NO_MEDIA,
    "default-mm-loras": NO_MEDIA,
    "enable-tower-connector-lora": NO_MEDIA,
    "lora-target-modules": "tandem serve applies each adapter to the layers it targets",
    "max-lora-cls-labels": "tandem serve has no classification heads",
    "per-request-spec-decode-metrics": "tandem serve does not decode speculatively",
    "max-num-queued-reqs": "tandem serve queues every request it admits",
    "max-num-queued-tokens": "tandem serve queues every request it admits",
    "scheduling-policy": "tandem serve schedules first come, first served",
    "aux-output-config": "tandem serve does not report MoE routing",
    "diffusion-config": "tandem serve runs autoregressive models",
    "structured-outputs-config": NO_GUIDED,
    "watermark-config": "tandem serve does not watermark",
}
"""vLLM's flags that change what a server answers, which tandem serve does not implement: the reason for each."""

DEFAULTS = {
    "kv-cache-dtype": ("auto",),
    "load-format": ("auto", "safetensors"),
    "tokenizer-mode": ("auto", "hf"),
    "config-format": ("auto", "hf"),
    "model-impl": ("auto", "transformers"),
    "runner": ("auto", "generate"),
    "convert": ("auto", "none"),
    "scheduling-policy": ("fcfs",),
    "sse-keep-alive-interval": ("0",),
}
"""Values of refused flags that ask for what tandem serve does anyway: taken."""

ALREADY_SO = {
    "enforce-eager": "tandem serve always runs eagerly",
    "disable-log-requests": "tandem serve does not log requests",
    "no-enable-log-requests": "tandem serve does not log requests",
    "disable-log-stats": "tandem serve does not log engine statistics",
    "disable-uvicorn-access-log": "tandem serve does not log each access",
    "disable-fastapi-docs": "tandem serve has no /docs page",
    "language-model-only": "tandem serve serves the language model only",
}
"""Flags whose promise tandem serve keeps on its own: taken (switches, as in vLLM)."""

OPPOSITES = (("no-", ""), ("disable-", "enable-"), ("enable-", "disable-"))
"""vLLM 0.33's negations of a switch: --no-X of --X, --disable-X of --enable-X and the other way round."""


def verdict(name: str, value: str | None) -> tuple[str, str]:
    """What `tandem serve` does with vLLM's flag `--name [value]`, one of tandem's own or not: ("take", why) for a
    flag it keeps the promise of (left out of its options), ("refuse", the line that says why), or ("unknown", "")
    for a flag vLLM has not either."""
    name = name.replace("_", "-")
    if name in ALREADY_SO:
        return "take", ALREADY_SO[name]
    if name in REFUSED:
        if value is not None and value in DEFAULTS.get(name, ()):
            return "take", f"{value} is what tandem serve does"
        return "refuse", f"--{name} is not supported: {REFUSED[name]}"
    if name in ENGINE_TUNING:
        return "refuse", (
            f"--{name} tunes vLLM's engine (parallelism, memory, kernels, logging), which tandem serve "
            "does not have: leave it out, or serve with vllm serve"
        )
    for prefix, other in OPPOSITES:  # the negation of a refused switch asks for its default
        if name.startswith(prefix) and other + name[len(prefix) :] in REFUSED:
            return "take", "the default"
    return "unknown", ""


def takes_value(name: str) -> bool:
    """Whether a flag `verdict` takes is followed by its value (the refused flags' default values); the others taken
    are switches."""
    return name.replace("_", "-") in DEFAULTS
