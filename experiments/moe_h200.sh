#!/usr/bin/env bash
# MoE on ONE H200 (issue 29), one part per device call (each under its 10-minute limit):
#
#     bash experiments/moe_h200.sh OUT_DIR kernel   # grouped GEMM: -m gpu tests + benchmark
#     bash experiments/moe_h200.sh OUT_DIR moe      # qwen3-30b-a3b through the engine + HF
#     bash experiments/moe_h200.sh OUT_DIR dense    # qwen3-a3b-dense (same active parameters)
#     bash experiments/moe_h200.sh OUT_DIR compare  # moe_vs_dense.json/.png from the two above
#
# kernel -> OUT_DIR/gpu_tests_grouped_matmul.json, OUT_DIR/grouped_matmul.json
# moe    -> OUT_DIR/e2e_qwen3_30b_a3b.json: decode at batches 1/8/64/256 (context 512) against
#           the roofline of the experts actually routed to, offline 128/128 throughput, and
#           transformers' eager generate on the same shape (random bf16 weights, ~61 GB; it runs
#           first, in a child process, before the engine takes the GPU)
# dense  -> OUT_DIR/e2e_qwen3_a3b_dense.json: the same decode and throughput rows
# Set PYTHON (default python3) and PYTHONPATH as the other H200 scripts do (docs/gpu.md).
set -euo pipefail

OUT_DIR=${1:?usage: experiments/moe_h200.sh OUT_DIR kernel|moe|dense|compare}
PART=${2:?usage: experiments/moe_h200.sh OUT_DIR kernel|moe|dense|compare}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$OUT_DIR"
E2E=(--dtype bfloat16 --batches 1 8 64 256 --contexts 512 --max-num-seqs 256
     --decode-buckets 1 8 64 256 --max-num-batched-tokens 2048 --workloads fixed
     --num-requests 512 --compile-cache /tmp/jaxinfer_jax_cache)

case "$PART" in
kernel)
    timeout 300 "$PYTHON" "$HERE/run_gpu_tests.py" --out "$OUT_DIR/gpu_tests_grouped_matmul.json" \
        -- tests/test_grouped_matmul_kernel.py || echo "gpu tests rc $?"
    timeout 280 "$PYTHON" "$HERE/bench_grouped_matmul.py" --out "$OUT_DIR/grouped_matmul.json" ||
        echo "bench rc $?"
    ;;
moe)
    timeout 590 "$PYTHON" "$HERE/bench_e2e.py" --preset qwen3-30b-a3b "${E2E[@]}" \
        --parts decode,throughput,transformers --hf-batch-sizes 16 64 --hf-num-requests 64 \
        --out "$OUT_DIR/e2e_qwen3_30b_a3b.json"
    ;;
dense)
    timeout 590 "$PYTHON" "$HERE/bench_e2e.py" --preset qwen3-a3b-dense "${E2E[@]}" \
        --parts decode,throughput --out "$OUT_DIR/e2e_qwen3_a3b_dense.json"
    ;;
compare)
    "$PYTHON" "$HERE/moe_vs_dense.py" --moe "$OUT_DIR/e2e_qwen3_30b_a3b.json" \
        --dense "$OUT_DIR/e2e_qwen3_a3b_dense.json" --out "$OUT_DIR/moe_vs_dense.json" \
        --plot "$OUT_DIR/moe_vs_dense.png"
    ;;
*)
    echo "unknown part $PART: kernel, moe, dense or compare" >&2
    exit 2
    ;;
esac
