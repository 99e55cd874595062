#!/usr/bin/env bash
# vLLM for the serving benchmark's vLLM arm, carried to a GPU machine that
# cannot reach a package registry.
#
# The GPU image has torch 2.11 (CUDA 13), transformers, tokenizers,
# safetensors, numpy, requests, tqdm, pyyaml, psutil, pillow, jinja2 and
# protobuf; vLLM 0.26.0 is the newest release built for that torch. What is
# carried: the vllm wheel (trimmed, below), flashinfer-python 0.6.14 and the
# Requires-Dist that vLLM's offline `LLM` class, its V1 engine core, the
# Llama model and the FA3 / FlashInfer attention backends import at module
# level (read off vLLM's sources by their import statements; HTTP-server,
# structured-output, multimodal-media and MoE-only dependencies are left
# out). Everything is installed with --no-deps into /tmp/vllm_site, which a
# .pth file in the interpreter's site-packages APPENDS to sys.path, so the
# image's own copy of any package wins. A .pth file, not `sys.path.append`:
# vLLM inspects model classes in a subprocess (`python -m ...`), which would
# not see a path appended at run time.
#
# Trimmed from the vllm wheel: vllm_flash_attn/_vllm_fa2_C.abi3.so (FlashAttention
# 2, for pre-Hopper GPUs; vLLM picks FA3 on compute capability 9.x and
# imports FA2 inside try/except) and the vllm-rs binary (the Rust HTTP
# frontend of `vllm serve`). RECORD drops their lines.
#
# Run on an H200 (`bench.engine --vllm`): vLLM's V1 engine with
# torch.compile, CUDA graphs and its FA3 backend.
#
# Usage:
#   here (network):  bash bench/tools/vllm_wheels.sh download
#       -> .vllm_a/part, .vllm_b/part, ... (< 60 MiB each; git-ignored via
#          .git/info/exclude), and prints the device commands;
#   device, one call per part, consecutively (the machine stays warm only
#   briefly between calls), each run() carrying that one folder:
#                    bash bench/tools/vllm_wheels.sh stash
#   device, last:    bash bench/tools/vllm_wheels.sh install
#       -> /tmp/vllm_site, on sys.path through zz_vllm_site.pth;
#          check: python3 -c "import vllm; print(vllm.__version__)"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DOWNLOADS="${VLLM_WHEELS_DIR:-/tmp/vllm_wheels}/pip"  # as pip fetched them
WHEELS="${VLLM_WHEELS_DIR:-/tmp/vllm_wheels}/carry"   # what travels
PARTS=/tmp/vllm_parts
SITE=/tmp/vllm_site
PART_MIB=58
# The image is Python 3.12 on glibc 2.39 (Ubuntu 24.04): manylinux up to 2_35.
PIP_TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
            --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
            --platform manylinux_2_31_x86_64 --platform manylinux_2_27_x86_64
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
            --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
            --platform manylinux1_x86_64)
# Resolved with their own dependencies (all small, pure Python or one .so).
WITH_DEPS=(
  "openai>=2.0.0" "openai-harmony>=0.0.3" "pydantic>=2.12.0"
  "fastapi<0.137.0,>=0.133.0" "starlette>=1.0.1" "aiohttp>=3.13.3"
  "prometheus_client>=0.18.0" cachetools cloudpickle msgspec "pyzmq>=25.0.0"
  py-cpuinfo cbor2 pybase64 partial-json-parser uvloop einops nvidia-ml-py
  blake3 setproctitle python-json-logger "depyf==0.20.0"
)
# Exact pins whose own dependencies (torch, transformers, numpy) the image has.
NO_DEPS=(
  "vllm==0.26.0" "flashinfer-python==0.6.14" "apache-tvm-ffi==0.1.10"
  "compressed-tensors==0.17.0" nvidia-cudnn-frontend gguf
  # vLLM's V1 request module imports the structured-output backends at
  # import time; xgrammar 0.2.8 needs a newer apache-tvm-ffi than vLLM pins.
  "llguidance<1.8.0,>=1.7.0" "xgrammar==0.2.7"
)
# Dependencies the image already has: not carried.
IMAGE_HAS='^(numpy|torch|triton|transformers|tokenizers|safetensors|requests|urllib3|charset_normalizer|idna|certifi|tqdm|pyyaml|PyYAML|filelock|packaging|typing_extensions|jinja2|Jinja2|markupsafe|MarkupSafe|pillow|psutil|protobuf|huggingface_hub|fsspec|regex|sympy|mpmath|networkx|setuptools)-'

trim_vllm() {
  local whl dir
  whl=$(ls "$WHEELS"/vllm-0.26.0-*.whl)
  dir=$(mktemp -d)
  ( cd "$dir" && unzip -q "$whl" vllm-0.26.0.dist-info/RECORD &&
    grep -v -e '^vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so,' -e '^vllm/vllm-rs,' \
      vllm-0.26.0.dist-info/RECORD > RECORD.new &&
    mv RECORD.new vllm-0.26.0.dist-info/RECORD )
  zip -q -d "$whl" vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs || true
  ( cd "$dir" && zip -q "$whl" vllm-0.26.0.dist-info/RECORD )
  rm -rf "$dir"
}

case "${1:-}" in
  download)
    mkdir -p "$DOWNLOADS"
    python3 -m pip download -q -d "$DOWNLOADS" "${PIP_TARGET[@]}" "${WITH_DEPS[@]}"
    python3 -m pip download -q -d "$DOWNLOADS" "${PIP_TARGET[@]}" --no-deps "${NO_DEPS[@]}"
    rm -rf "$WHEELS" && cp -r "$DOWNLOADS" "$WHEELS"
    ( cd "$WHEELS" && ls | grep -E "$IMAGE_HAS" | xargs -r rm -f )
    unzip -l "$WHEELS"/vllm-0.26.0-*.whl > "$WHEELS.list"
    if grep -q _vllm_fa2_C "$WHEELS.list"; then trim_vllm; fi
    rm -f "$WHEELS.list"
    rm -rf "$ROOT"/.vllm_?
    tmp=$(mktemp -d)
    tar -C "$WHEELS" -cf "$tmp/wheels.tar" .
    ( cd "$tmp" && split -b "${PART_MIB}m" -a 1 wheels.tar part_ )
    for f in "$tmp"/part_?; do
      s=${f##*_}
      mkdir -p "$ROOT/.vllm_$s"
      mv "$f" "$ROOT/.vllm_$s/part"
      grep -qx "/.vllm_$s/" "$ROOT/.git/info/exclude" 2>/dev/null ||
        echo "/.vllm_$s/" >> "$ROOT/.git/info/exclude"
    done
    sha256sum "$tmp/wheels.tar" | cut -d' ' -f1 > "$ROOT/.vllm_a/sha256"
    rm -rf "$tmp"
    ls -la "$WHEELS"
    du -b "$ROOT"/.vllm_?/part
    echo "device: one run() per folder, carry=[\".vllm_X\"], command" \
         "'bash bench/tools/vllm_wheels.sh stash'; then 'bash bench/tools/vllm_wheels.sh install'"
    ;;
  stash)  # device: move the carried part(s) to /tmp
    mkdir -p "$PARTS"
    for d in "$ROOT"/.vllm_?; do
      [ -f "$d/part" ] || continue
      s=${d##*_}
      cp "$d/part" "$PARTS/part_$s"
      [ -f "$d/sha256" ] && cp "$d/sha256" "$PARTS/sha256"
      echo "stashed part_$s"
    done
    ls -la "$PARTS"
    ;;
  install)  # device: join, check, install into /tmp/vllm_site
    cat "$PARTS"/part_? > /tmp/vllm_wheels.tar
    if [ -f "$PARTS/sha256" ]; then
      echo "$(cat "$PARTS/sha256")  /tmp/vllm_wheels.tar" | sha256sum -c -
    fi
    mkdir -p /tmp/vllm_wheels_dev && tar -C /tmp/vllm_wheels_dev -xf /tmp/vllm_wheels.tar
    python3 -m pip install -q --no-index --no-deps --target "$SITE" /tmp/vllm_wheels_dev/*.whl
    echo "$SITE" > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/zz_vllm_site.pth"
    python3 - <<PY
import vllm, flashinfer
from vllm import LLM, SamplingParams
print("vllm", vllm.__version__, "flashinfer", flashinfer.__version__)
PY
    ;;
  *)
    echo "usage: $0 download|stash|install" >&2; exit 2 ;;
esac
