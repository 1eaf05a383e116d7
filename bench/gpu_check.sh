#!/usr/bin/env bash
# GPU check for a lent CUDA machine (needs only torch, triton, transformers, safetensors,
# typer, rich), unattended, under 8 minutes on an H200 (each step has its own timeout;
# they add up to 480 s):
#   1. kernel parity on CUDA: the general and the planned decode kernels, exact fp32
#      dots (the planned path's inline-PTX decode included), and the CUDA-graph capture;
#      then the vector-codebook (vq) layouts, down to greedy generate with a vq cache,
#      and their planned path (Gemma 3's head shape; slots patched under fp16 dots), and
#      the trellis layouts' planned path (Gemma 3's head shape, 4- and 3-bit digits) and
#      their appends' Viterbi search;
#      then every layer's decode step through the cache captured in a CUDA graph and
#      replayed token after token against eager (tests/runtime/test_replayable_step.py);
#   2. decode attention per format (trellis TR4/TR3/TR2 included) and head shape
#      (Llama-like 8 x 128, Gemma 3 1 x 256):
#      us, GB/s, share of the HBM peak, speed against fp16 SDPA and the launch chosen
#      (plan: splits, programs, waves, fill; configuration); then KV4 through the general
#      kernel for comparison;
#   3. Gemma 3 270M at batch 16 through generate: kvq int4 cache vs fp16 DynamicCache,
#      decoded tokens per second;
#   4. the A8 producer benchmark.
# Usage: bash bench/gpu_check.sh [OUT_DIR]
set -u
OUT=${1:-${OUT:-gpu_out}}
mkdir -p "$OUT"
export PYTHONPATH=$PWD KVQ_TEST_CUDA=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
echo "== parity: decode attention on CUDA (append kernels: KVQ_TEST_CUDA=1 pytest tests/runtime/kernels/test_append.py)"
KVQ_TRITON_DOT=ieee timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/runtime/kernels/test_planned_decode.py tests/runtime/kernels/test_decode_attention.py 2>&1 | tail -15
KVQ_TRITON_DOT=ieee timeout 90 python3 -m pytest -q -p no:cacheprovider \
  tests/runtime/kernels/test_decode_vq.py \
  tests/runtime/kernels/test_planned_trellis.py::test_trellis_layer_call_matches_reference_mqa_256 \
  tests/runtime/kernels/test_trellis_encode.py::test_digits_are_the_torch_search \
  tests/runtime/kernels/test_planned_vq.py::test_vq_layer_call_matches_reference_mqa_256 \
  tests/runtime/kernels/test_planned_vq.py::test_fp16_dots_patch_value_slots_into_the_centroid_words \
  2>&1 | tail -8
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_replayable_step.py \
  -k "cuda_graph and (sink2 or int8)" 2>&1 | tail -8
echo "== decode attention benchmark (per format and shape: us, GB/s, HBM share, launch)"
timeout 140 python3 bench/gpu_decode.py --json "$OUT/gpu_decode.json" 2>&1 \
  | grep -v -i "warn" | tail -80
echo "== Gemma 3 270M, batch 16, generate: kvq int4 vs fp16 DynamicCache"
timeout 60 python3 bench/gpu_generate.py --new 32 --json "$OUT/gpu_generate.json" 2>&1 | tail -5
echo "== A8 producer benchmark"
timeout 30 python3 bench/a8_gpu.py --json "$OUT/a8_gpu.json" 2>&1 | tail -20
