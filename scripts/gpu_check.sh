#!/usr/bin/env bash
# The GPU check, one prepared script: the CUDA tests (on two GPUs or more also the NCCL tests of tensor and
# pipeline parallel), then bench.py on random weights of published shapes (no download): Llama-2-7B batch-1
# decode compiled with CUDA graphs in bf16 (and where its step's time goes: --profile), int4 and int8, a
# 2048-token bf16 prefill against the measured matmul peak, Llama-3-8B (GQA, untied 128k head) in bf16, and the
# serving engine decoding 1, 16, 64 and 256 sequences together (CUDA graphs per batch bucket). It ends with one
# table of every run (bench.py --table). Each step has its own time limit, so one slow step cannot take the rest
# with it; the limits add up to under the device's 10-minute call.
#   bash scripts/gpu_check.sh [OUT_DIR]      (needs a CUDA GPU with ~40 GB free; about 8 minutes on an H200)
#   bash scripts/gpu_check.sh --wheels       (first, on a machine where pip reaches the registry: into .whl/, git-ignored,
#                                     the packages a GPU machine's image may lack; carry .whl to it and this
#                                     script installs them there)
set -u
cd "$(dirname "$0")/.."  # the repository root: the tests, scripts and .whl are named from there
if [ "${1:-}" = "--wheels" ]; then  # gguf (pure Python) and llguidance (abi3), the versions installed here
    rm -rf .whl && mkdir .whl
    platforms=$(for n in 17 27 28 31 34 35 39; do printf -- "--platform manylinux_2_%s_x86_64 " "$n"; done)
    for pkg in gguf llguidance; do
        version=$(python3 -c "import importlib.metadata as m; print(m.version('$pkg'))") || exit 1
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            $platforms -d .whl "$pkg==$version" || exit 1
    done
    ls .whl
    exit 0
fi
out=${1:-gpu_check_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache}
if [ -d .whl ]; then  # carried from `bash scripts/gpu_check.sh --wheels`
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import gguf, llguidance" || echo "== missing packages: run 'bash scripts/gpu_check.sh --wheels' where pip works and carry .whl"
step() {
    local limit=$1; shift
    echo "== $* (limit ${limit} s)"
    local t0=$SECONDS
    timeout "$limit" "$@"
    echo "== exit $? after $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
step 100 python3 -m pytest -q --maxfail=5 -p no:cacheprovider tests/test_cuda.py
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then  # NCCL: tensor and pipeline parallel
    step 120 python3 -m pytest -q -p no:cacheprovider tests/test_tp.py tests/test_pp.py -k nccl
fi
bench="python3 -m scripts.bench --device cuda --dtype bfloat16 --runs 3 --quiet"
step 80 $bench --shape llama-2-7b --compile --profile --json "$out/llama2_bf16.json"
step 75 $bench --shape llama-2-7b --compile --quantize int4 --json "$out/llama2_int4.json"
step 75 $bench --shape llama-2-7b --compile --quantize int8 --json "$out/llama2_int8.json"
step 30 $bench --shape llama-2-7b --compile none --prompt-len 2048 --new-tokens 2 --json "$out/llama2_prefill.json"
step 80 $bench --shape llama-3-8b --compile --json "$out/llama3_bf16.json"
step 130 $bench --shape llama-2-7b --compile --engine --batch-size 1 16 64 256 --new-tokens 64 --runs 2 \
    --json "$out/llama2_engine.json"
python3 -m scripts.bench --table "$out"/*.json
