#!/usr/bin/env bash
# GPU check for a lent CUDA machine (needs only torch, triton, transformers, safetensors,
# typer, rich): kernel parity on CUDA, then decode-attention and A8 benchmarks.
# Usage: bash bench/gpu_check.sh [OUT_DIR]   (under 8 minutes on an H200; the first call per format autotunes the decode kernel over 12 configurations, with and without PREFETCH where codes load as words)
set -u
OUT=${1:-${OUT:-gpu_out}}
mkdir -p "$OUT"
export PYTHONPATH=$PWD KVQ_TEST_CUDA=1
unset TRITON_INTERPRET
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
echo "== parity: decode attention on CUDA (append kernels: KVQ_TEST_CUDA=1 pytest tests/runtime/kernels/test_append.py)"
KVQ_TRITON_DOT=ieee timeout 130 python3 -m pytest -q -p no:cacheprovider tests/runtime/kernels/test_decode_attention.py 2>&1 | tail -15
echo "== decode attention benchmark"
timeout 290 python3 bench/gpu_decode.py --json "$OUT/gpu_decode.json" 2>&1 | tail -45
echo "== A8 producer benchmark"
timeout 50 python3 bench/a8_gpu.py --json "$OUT/a8_gpu.json" 2>&1 | tail -20
