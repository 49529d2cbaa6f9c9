#!/usr/bin/env bash
# Weight formats on XLA (issue 27): decode step time and 128/128 throughput of the Llama-3-8B
# shape (random weights, quantized on the device) per format, on ONE H200 in about 7 minutes.
#
#     bash experiments/quant_xla_h200.sh OUT_DIR       # then OUT_DIR/quant_xla.json (merged)
#     SMOKE=1 PYTHON=.venv/bin/python bash experiments/quant_xla_h200.sh /tmp/qx   # CPU, tiny
#
# 1. decode (`bench_e2e.py --parts decode`) at DECODE_BATCHES (default 1 and 64), context 512,
#    one process per format in DECODE_FORMATS -> OUT_DIR/quant_xla_<fmt>.json;
# 2. throughput 128/128 (`--parts throughput --workloads fixed`, NUM_REQUESTS requests) for each
#    of THROUGHPUT_FORMATS while the elapsed time is under TIME_BUDGET_S ->
#    OUT_DIR/quant_xla_tput_<fmt>.json;
# 3. `merge_quant_xla.py` -> OUT_DIR/quant_xla.json, and OUT_DIR/quant_xla_runs.tar.gz with every
#    run's JSON and log (the device tool returns at most 8 files).
#
# Each run is its own process under `timeout` (RUN_TIMEOUT_S, and none past HARD_LIMIT_S): a
# format that fails or hangs is recorded in OUT_DIR/driver_runs.jsonl (rc, seconds) and the
# others go on; a run the budgets leave out is recorded there as skipped. Every engine is trimmed
# to the buckets its batches use (decode rows DECODE_BATCHES, mixed steps of as many tokens as
# the largest; throughput: 256 rows, 256-2048 tokens), and JAX's persistent compilation cache (/tmp/jaxinfer_jax_cache) lets a
# second call on the same warm machine skip the compiles, e.g. for what the first skipped:
#     DECODE_FORMATS="int4_g128_sym nvfp4" THROUGHPUT_FORMATS=none bash ... OUT_DIR2
set -euo pipefail

OUT_DIR=${1:?usage: experiments/quant_xla_h200.sh OUT_DIR}
PYTHON=${PYTHON:-python3}
TIME_BUDGET_S=${TIME_BUDGET_S:-400}     # no throughput run starts after this many seconds
DECODE_BUDGET_S=${DECODE_BUDGET_S:-420} # no decode run starts after this many seconds
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-170}     # one process (an 8B warm-up compiles in ~30-60 s)
HARD_LIMIT_S=${HARD_LIMIT_S:-540}       # every run is stopped by then (the device call: 600 s)
MIN_RUN_S=${MIN_RUN_S:-60}              # a run with less time than this left is not started
NUM_REQUESTS=${NUM_REQUESTS:-256}
# (set but empty: no run of that part)
DECODE_FORMATS=${DECODE_FORMATS-"none fp8_tensor fp8_channel fp8_block int8 int4_g128_sym nvfp4"}
THROUGHPUT_FORMATS=${THROUGHPUT_FORMATS-"none fp8_tensor fp8_channel"}
DECODE_BATCHES=${DECODE_BATCHES:-"1 64"}
BENCH_ARGS=${BENCH_ARGS:-}  # more bench_e2e.py arguments for every run, e.g. --xla-options ...
read -r -a EXTRA <<<"$BENCH_ARGS"
read -r -a BATCHES <<<"$DECODE_BATCHES"
MAX_BATCH=$(printf '%s\n' "${BATCHES[@]}" 64 | sort -n | tail -n 1)
CACHE=${COMPILE_CACHE:-/tmp/jaxinfer_jax_cache}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BENCH="$HERE/bench_e2e.py"
if [[ "${SMOKE:-0}" == 1 ]]; then  # the same pipeline on a CPU: tiny preset, tiny shapes
    MODEL=(--smoke)
    DECODE=(--batches 1 4 --contexts 16 --max-num-seqs 4 --decode-buckets 1 4
            --max-num-batched-tokens 16 --workloads fixed --num-requests 4)
    THROUGHPUT=(--batches 4 --contexts 16 --max-num-seqs 4 --max-num-batched-tokens 16
                --workloads fixed --num-requests 8)
else
    MODEL=(--preset llama3-8b --dtype bfloat16)
    # --workloads fixed: max_model_len fits context 512 (+ a scan), not ShareGPT's 2k requests
    DECODE=(--batches "${BATCHES[@]}" --contexts 512 --max-num-seqs "$MAX_BATCH"
            --decode-buckets "${BATCHES[@]}" --max-num-batched-tokens "$MAX_BATCH"
            --workloads fixed --num-requests 8)
    THROUGHPUT=(--batches 256 --contexts 512 --max-num-seqs 256 --max-num-batched-tokens 2048
                --workloads fixed --num-requests "$NUM_REQUESTS")
fi

mkdir -p "$OUT_DIR"
COMMAND="DECODE_FORMATS=\"$DECODE_FORMATS\" THROUGHPUT_FORMATS=\"$THROUGHPUT_FORMATS\" \
DECODE_BATCHES=\"$DECODE_BATCHES\" BENCH_ARGS=\"$BENCH_ARGS\" NUM_REQUESTS=$NUM_REQUESTS RUN_TIMEOUT_S=$RUN_TIMEOUT_S \
HARD_LIMIT_S=$HARD_LIMIT_S bash experiments/quant_xla_h200.sh $OUT_DIR"
"$PYTHON" -c 'import json, sys; print(json.dumps({"command": sys.argv[1]}))' "$COMMAND" \
    >"$OUT_DIR/driver.json"  # (merge_quant_xla.py records it)
RUNS="$OUT_DIR/driver_runs.jsonl"
: >"$RUNS"
START=$SECONDS

record() {  # part format status rc seconds reason
    local line='{"part": "%s", "format": "%s", "status": "%s", "rc": %s, "seconds": %s, "reason": "%s"}'
    printf "$line\n" "$1" "$2" "$3" "$4" "$5" "$6" >>"$RUNS"
}

run_one() {  # part format budget_s out_json bench-args...
    local part=$1 fmt=$2 budget=$3 out=$4
    shift 4
    local elapsed=$((SECONDS - START))
    local limit=$((HARD_LIMIT_S - elapsed))
    if ((limit > RUN_TIMEOUT_S)); then
        limit=$RUN_TIMEOUT_S
    fi
    if ((elapsed >= budget || limit < MIN_RUN_S)); then
        local why="${elapsed} s elapsed: budget ${budget} s, hard limit ${HARD_LIMIT_S} s"
        echo "== skip $part $fmt: $why"
        record "$part" "$fmt" skipped null 0 "$why"
        return 0
    fi
    echo "== $part $fmt (at ${elapsed}s, limit ${limit}s)"
    local t0=$SECONDS rc=0
    timeout --signal=TERM --kill-after=10 "$limit" \
        "$PYTHON" "$BENCH" "${MODEL[@]}" --quant "$fmt" --compile-cache "$CACHE" \
        --out "$out" "$@" "${EXTRA[@]}" >"${out%.json}.log" 2>&1 || rc=$?
    local status=ok
    if ((rc == 124 || rc == 137)); then
        status=timeout
    elif ((rc != 0)); then
        status=failed
    fi
    record "$part" "$fmt" "$status" "$rc" $((SECONDS - t0)) ""
    echo "   $status rc=$rc in $((SECONDS - t0))s; its last rows and errors:"
    (grep -E '^\{|Error|error' "${out%.json}.log" || true) | tail -n 3 | cut -c1-200 |
        sed 's/^/   | /'
}

for fmt in $DECODE_FORMATS; do
    run_one decode "$fmt" "$DECODE_BUDGET_S" "$OUT_DIR/quant_xla_$fmt.json" --parts decode \
        "${DECODE[@]}"
done
for fmt in $THROUGHPUT_FORMATS; do
    run_one throughput "$fmt" "$TIME_BUDGET_S" "$OUT_DIR/quant_xla_tput_$fmt.json" \
        --parts throughput "${THROUGHPUT[@]}"
done

echo "== merge (at $((SECONDS - START))s)"
"$PYTHON" "$HERE/merge_quant_xla.py" "$OUT_DIR" --out "$OUT_DIR/quant_xla.json" ||
    echo "merge failed (rc $?): the per-run JSONs are in the archive"
# (quant_xla_*.json: the per-run files; the merged quant_xla.json has no underscore after the name)
(cd "$OUT_DIR" && tar -czf quant_xla_runs.tar.gz driver.json driver_runs.jsonl quant_xla_*.json \
    quant_xla_*.log) || echo "archive incomplete (rc $?)"
echo "== done in $((SECONDS - START))s: $OUT_DIR/quant_xla.json, $OUT_DIR/quant_xla_runs.tar.gz"
