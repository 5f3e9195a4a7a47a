#!/usr/bin/env bash
# Makes the folder to carry to the GPU machine (no network there; Python 3.12, torch 2.11)
# for the GPU tests and the benchmark of kvbm_ext.integrations.vllm:
#
#   tools/vllm_gpu_carry.sh [DIR]          # default .carry-vllm (ignore it: .git/info/exclude)
#
# DIR/vllm-0.26.0-py.zip   vLLM 0.26.0's pure-Python files (the version that pins torch 2.11),
#                          without its compiled libraries, C++ headers and Rust binary, with
#                          tools/vllm_ops_standin.py as vllm/_C_stable_libtorch.py
# DIR/wheels/              the packages vLLM imports that the GPU machine's Python lacks,
#                          cp312 manylinux wheels, installed there with --no-deps
# DIR/vllm-cache/          vLLM's model-info cache of LlamaForCausalLM (made here: on CUDA vLLM
#                          would inspect it by importing its compiled flash-attention library)
# DIR/run-gpu-tests.sh     what runs there: bash DIR/run-gpu-tests.sh [SRC] [OUT]
# About 27 MiB.  On the GPU machine:  bash .carry-vllm/run-gpu-tests.sh . "$OUT"
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-$ROOT/.carry-vllm}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$DIR/wheels"

python3 -m pip download -q --no-deps vllm==0.26.0 -d "$WORK"
(cd "$WORK" && python3 -m zipfile -e vllm-0.26.0-*.whl unpacked)
mkdir -p "$WORK/unpacked/vllm" && cp "$ROOT/tools/vllm_ops_standin.py" "$WORK/unpacked/vllm/_C_stable_libtorch.py"
rm -f "$DIR/vllm-0.26.0-py.zip"
(cd "$WORK/unpacked" && zip -qr -9 "$DIR/vllm-0.26.0-py.zip" vllm vllm-0.26.0.dist-info -x "*.so" -x "*.hpp" -x "*.h" \
    -x "*.cuh" -x "*.cu" -x "*.cpp" -x "vllm/vllm-rs" -x "*/static/*" -x "*__pycache__*")

PLATFORMS=""
for glibc in 5 17 24 26 27 28 31; do PLATFORMS="$PLATFORMS --platform manylinux_2_${glibc}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR/wheels" \
    annotated-types==0.7.0 apache-tvm-ffi==0.1.11 cachetools==8.0.2 cbor2==6.3.0 distro==1.9.0 fastapi==0.136.3 \
    httpcore2==2.16.2 httpx2==2.16.2 jiter==0.19.0 llguidance==1.7.6 msgspec==0.22.0 openai==3.57.0 \
    openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.13.4 \
    pydantic-core==2.46.4 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5 \
    typing-inspection==0.4.2 xgrammar==0.2.8
# vLLM's model-info cache for the tests' Llama config, made here on the CPU with the same
# vLLM files (VLLM_PYTHON: a Python with vLLM's dependencies, e.g. the venv of
# tests/requirements-vllm.txt).
rm -rf "$DIR/vllm-cache" && mkdir -p "$WORK/model"
printf '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "num_attention_heads": 8,
  "num_key_value_heads": 4, "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 1024}' > "$WORK/model/config.json"
(cd "$WORK" && PYTHONPATH="$WORK/unpacked" VLLM_CACHE_ROOT="$DIR/vllm-cache" HF_HUB_OFFLINE=1 "${VLLM_PYTHON:-python3}" -c \
    "from vllm.config import ModelConfig; ModelConfig(model='$WORK/model', skip_tokenizer_init=True)" > /dev/null)
cp "$ROOT/tools/vllm_gpu_tests.sh" "$DIR/run-gpu-tests.sh"
du -sh "$DIR"
