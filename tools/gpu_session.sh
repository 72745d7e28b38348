#!/usr/bin/env bash
# Contributor tooling for the project's air-gapped GPU host (docs/contributing/gpu-host.md).
# Runs every workflow tool (offload.tools, docs/tools.md) for real on the GPU machine and writes
# results, logs, pictures and the test fixtures under $OUT/tools/ (fixtures under
# $OUT/tools/fixtures/, named as tests/fixtures/tools/ expects them). The steps get at most
# BUDGET_S (200) seconds: a step that would run past it is cut (rc 124) or skipped; with the
# packing, the script stays under 4 minutes.
#
# At the end EVERYTHING under $OUT/tools/ is packed into ONE archive, $OUT/tools.tgz, and the
# loose files are deleted: $OUT holds only tools.tgz and summary.txt (the device tool brings back
# a handful of files). Unpack with: tar xzf tools.tgz   (gives tools/...)
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#   bash tools/gpu_session.sh            # from the repository root; OUT defaults to ./gpu_out
#
# Each step's stdout goes to $OUT/tools/<step>.log, its stderr to <step>.err, its exit status to
# $OUT/tools/steps.txt;
# a failing step does not stop the others.
set -u

OUT=${OUT:-$PWD/gpu_out}
T=$OUT/tools
F=$T/fixtures
mkdir -p "$T" "$F"
PY=${PYTHON:-python3}
: > "$T/steps.txt"
START=$(date +%s)

# the full-size workload (the issue's example) and a small one for fixtures
# (override with BIG_ARGS / SMALL_ARGS, e.g. a smaller stack if time demands)
read -r -a BIG <<< "${BIG_ARGS:---hidden 4096 --heads 32 --layers 8 --seq 4096 --batch 1 --dtype bf16}"
read -r -a SMALL <<< "${SMALL_ARGS:---hidden 1024 --heads 8 --layers 4 --seq 2048 --batch 1 --dtype bf16}"

DEADLINE=$(( START + ${BUDGET_S:-200} ))  # the steps; packing takes a few seconds more

step() {  # step NAME TIMEOUT_S COMMAND... : stdout+stderr to NAME.log, rc to steps.txt
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    local left=$(( DEADLINE - t0 ))
    if [ "$left" -lt 5 ]; then
        printf '%-22s skipped (time budget spent)\n' "$name" | tee -a "$T/steps.txt"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout "$limit" "$@" > "$T/$name.log" 2> "$T/$name.err"
    local rc=$?
    printf '%-22s rc=%-3s %4ss\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" | tee -a "$T/steps.txt"
    return 0
}

json_get() {  # json_get FILE PYTHON_EXPR(d) DEFAULT
    $PY -c "import json,sys; d=json.load(open('$1')); print($2)" 2>/dev/null || echo "$3"
}

# 0. the machine
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    $PY -c "import matplotlib; print('matplotlib', matplotlib.__version__, '(pictures are PNG)')" 2>/dev/null \
        || echo "matplotlib: not installed (pictures are SVG)"
    $PY -c "import nvtx; print('nvtx', nvtx.__file__)" 2>/dev/null || echo "nvtx: not installed"
    command -v nsys || ls /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null || echo "nsys: not found"
} > "$T/env.txt" 2>&1
cat "$T/env.txt"

# 1. bandwidth probe (pinned and pageable, D2H/H2D/both, compute slowdown under copies)
step bandwidth 90 $PY -m offload.tools.bandwidth --sizes-mib 1 4 16 64 256 1024 --repeats 5 --out "$T/bandwidth.json"
cp "$T/bandwidth.log" "$T/bandwidth.md"
cp "$T/bandwidth.json" "$F/bandwidth.json" 2>/dev/null

# 2. module profile of the full-size stack
step profile 120 $PY -m offload.tools.profile_modules "${BIG[@]}" --steps 10 --warmup 3 --out "$T/profile.json"
cp "$T/profile.log" "$T/profile.md"
cp "$T/profile.json" "$F/profile_gpu.json" 2>/dev/null

# 3. advice: the free set (names together), and a budget 2.5 GiB below the measured peak
BW_ARG=(--bandwidth "$T/bandwidth.json")
[ -s "$T/bandwidth.json" ] || BW_ARG=(--link-gbps 50)
step advise 60 $PY -m offload.tools.advise --profile "$T/profile.json" "${BW_ARG[@]}" \
    --budget-below-peak-gib 2.5 --out "$T/advice.json"
cp "$T/advise.log" "$T/advice.md"

# 4. the advice against real runs: peaks within 10%, free modules and the free set within 2%
#    (median of 20 steps)
step advisor_check 150 $PY -m offload.tools.advisor_check --profile "$T/profile.json" --advice "$T/advice.json" \
    --steps 20 --warmup 3 --out "$T/check.json"
cp "$T/advisor_check.log" "$T/check.md"
cp "$T/check.json" "$F/check.json" 2>/dev/null

# the free set (core_attn if none) and its max_inflight_groups, for the overlap and memory runs
FREE=$(json_get "$T/advice.json" "','.join(d['free']) or 'core_attn'" core_attn)
INFLIGHT=$(json_get "$T/advice.json" "d.get('free_max_inflight_groups', 1) if d['free'] else 1" 1)
echo "free set: $FREE (max_inflight_groups $INFLIGHT)" | tee -a "$T/steps.txt"

# 5. overlap: a torch.profiler trace of 3 steps with the free set offloaded, report and picture
step overlap_record 90 $PY -m offload.tools.overlap record "${BIG[@]}" --modules "$FREE" \
    --max-inflight-groups "$INFLIGHT" --steps 3 --warmup 3 --out "$T/trace.json.gz"
step overlap_report 90 $PY -m offload.tools.overlap report "$T/trace.json.gz" --json "$T/overlap.json" \
    --png "$T/timeline.png"
cp "$T/overlap_report.log" "$T/overlap.md"
# the fixture: a small stack, 2 steps, two names
step overlap_fixture 60 $PY -m offload.tools.overlap record "${SMALL[@]}" --modules core_attn,fc1 --steps 2 \
    --warmup 2 --out "$F/trace_gpu.json.gz"

# 6. memory history with and without the free set, and the fixture (small stack)
step memory 120 $PY -m offload.tools.memory "${BIG[@]}" --modules "$FREE" --max-inflight-groups "$INFLIGHT" \
    --out "$T/memory"
step memory_fixture 60 $PY -m offload.tools.memory "${SMALL[@]}" --modules core_attn,fc1 --out "$T/memory_small"
cp "$T/memory_small/memory.json" "$F/memory_gpu.json" 2>/dev/null

# 7. the tools' tests, with the fixtures just recorded (in this machine's copy of the tree) and the GPU test
cp "$F"/* tests/fixtures/tools/ 2>/dev/null
step pytest_tools 120 $PY -m pytest -q -ra tests/test_tools.py

# 8. nsys: the command the tool would run, and whether nsys works here
step nsys_dry_run 10 $PY -m offload.tools.nsys_run --dry-run --out "$T/nsys" -- \
    $PY -m offload.tools.overlap record "${SMALL[@]}" --modules core_attn --steps 2 --out /tmp/nsys_trace.json
NSYS=$(command -v nsys || ls /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -n 1)
if [ -n "$NSYS" ]; then
    step nsys_run 45 $PY -m offload.tools.nsys_run --nsys "$NSYS" --out "$T/nsys" -- \
        $PY -m offload.tools.overlap record "${SMALL[@]}" --modules core_attn --steps 2 --out /tmp/nsys_trace.json
fi

# summary ($OUT/summary.txt, outside the archive)
{
    echo
    echo "== steps (total $(( $(date +%s) - START ))s)"
    cat "$T/steps.txt"
    echo
    echo "== advice"
    grep -E '^(Free set|The names free alone)' "$T/advice.md" 2>/dev/null
    echo
    echo "== advisor check"
    tail -n 20 "$T/check.md" 2>/dev/null
    tail -n 3 "$T/advisor_check.err" 2>/dev/null
    echo
    echo "== overlap"
    tail -n 3 "$T/overlap.md" 2>/dev/null
    echo
    echo "== memory"
    head -n 6 "$T/memory/memory.md" 2>/dev/null
    echo
    echo "== tests"
    grep -E '^(FAILED|ERROR|SKIPPED)|(passed|failed)' "$T/pytest_tools.log" 2>/dev/null | tail -n 15
    echo
    echo "== nsys"
    tail -n 2 "$T/nsys_run.log" "$T/nsys_run.err" 2>/dev/null
    echo
    echo "== files (in tools.tgz)"
    (cd "$T" && find . -type f | sort | xargs ls -la | awk '{print $5, $9}')
} > "$OUT/summary.txt" 2>&1

# pack everything under $OUT/tools/ into $OUT/tools.tgz and delete the loose files
rm -f "$OUT/tools.tgz"
if tar czf "$OUT/tools.tgz" -C "$OUT" tools; then
    size=$(stat -c %s "$OUT/tools.tgz")
    if [ "$size" -gt $(( 15 * 1024 * 1024 )) ]; then  # the device tool brings back files of 16 MiB at most
        echo "tools.tgz was $size bytes: packed again without the nsys capture (*.qdstrm)" >> "$OUT/summary.txt"
        tar czf "$OUT/tools.tgz" -C "$OUT" --exclude='*.qdstrm' tools
    fi
    rm -rf "$T"
    echo "packed: $OUT/tools.tgz ($(stat -c %s "$OUT/tools.tgz") bytes; tar xzf tools.tgz gives tools/)" >> "$OUT/summary.txt"
else
    echo "packing $OUT/tools.tgz FAILED: the loose files stay under $T" >> "$OUT/summary.txt"
fi
echo "total $(( $(date +%s) - START ))s" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
ls -la "$OUT"
