#!/usr/bin/env bash
# Contributor tooling for the project's air-gapped GPU host (docs/contributing/gpu-host.md).
# Issue 4 on the GPU machine: the CUDA-graph tests, the engine's CUDA regression tests, the
# host-time benchmark (eager vs captured offloading), and an A/B of copy_chunk_bytes on the MoE
# stack. Logs and results land in $OUT (default ./gpu_out).
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   OUT=$OUT bash tools/gpu_graphs.sh
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD || export PYTHONPATH=$PWD
export OFFLOAD_RESULTS_DIR=$OUT
run() { local name=$1; shift; local t0=$(date +%s); "$@" > "$OUT/$name.log" 2>&1; local rc=$?
        echo "$name rc=$rc $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/$name.log")" | tee -a "$OUT/summary.txt"; }
run graphs_tests python3 -m pytest -q -m cuda tests/test_cuda_graphs.py -p no:cacheprovider
run engine_tests python3 -m pytest -q -m cuda tests/test_cuda.py tests/test_cuda_pipeline.py -p no:cacheprovider
run graphs_bench python3 benchmarks/graphs.py --out "$OUT"
if [ "${AB:-1}" = 1 ]; then
    run ab_chunk16 python3 benchmarks/peers.py --sizes moe-l --configs offload:core_attn offload:expert_fc1 --no-sweep --out "$OUT/ab16"
    run ab_chunk0 python3 benchmarks/peers.py --sizes moe-l --configs offload:core_attn offload:expert_fc1 --no-sweep --copy-chunk-bytes 0 --out "$OUT/ab0"
    for d in ab16 ab0; do cp "$OUT/$d/peers.md" "$OUT/$d.md" 2>/dev/null; rm -rf "$OUT/$d"; done
fi
cat "$OUT/summary.txt"
