#!/usr/bin/env bash
# Contributor tooling for the project's air-gapped GPU host (docs/contributing/gpu-host.md).
# Issue 6 on the GPU machine: `offload` against save_on_cpu, torchtune, recompute (and TE /
# Megatron, recorded as not run where Transformer Engine is missing), GPT and MoE stacks at two
# sizes each, every configuration in its own process, then the scaling sweep. One command:
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   bash tools/gpu_peers.sh
#
# .whl/ must hold torchtune-0.6.1 and torchao-0.17.0 (torchtune's OffloadActivations imports
# torchao) besides megatron-core and nvtx; psutil and matplotlib are on the machine already.
# Everything lands in $OUT/peers/ (OUT defaults to ./gpu_out) and is packed at the end into ONE
# archive, $OUT/peers.tgz (the loose files are deleted): peers.json, peers.md, peers_*.png,
# env.txt, run.log, logs/<job>.log, traces/<job>.json.gz (dropped if the archive would pass
# 15 MB). The runner skips jobs that would start after BUDGET_S seconds (default 390) and stops
# any job after JOB_TIMEOUT_S (default 100), so the whole script stays under 8 minutes;
# a failing configuration is recorded (status "error" and its message in peers.json) and the
# others go on. EXTRA_ARGS is appended to the runner's command line.
set -u

OUT=${OUT:-$PWD/gpu_out}
P=$OUT/peers
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-390}
JOB_TIMEOUT_S=${JOB_TIMEOUT_S:-100}
START=$(date +%s)
rm -rf "$P" "$OUT/peers.tgz"
mkdir -p "$P"
if [ -d /tmp/site ]; then
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# Transformer Engine, installed by tools/gpu_te.sh (docs/contributing/gpu-host.md): the TE and Megatron rows run with it
[ -d /tmp/tesite ] && export PYTHONPATH=/tmp/tesite:$PYTHONPATH
export PYTHONUNBUFFERED=1
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

{
    echo "== $(date -u '+%Y-%m-%d %H:%M:%S UTC')  git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
        --format=csv,noheader 2>&1
    free -g | head -2
    $PY - <<'EOF'
import importlib.util, sys
from importlib import metadata
print("python", sys.version.split()[0])
for name in ("torch", "torchtune", "torchao", "psutil", "nvtx", "megatron-core", "matplotlib", "transformer-engine",
             "transformer-engine-torch"):
    try:
        print(f"{name:20s} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name:20s} not installed")
EOF
} > "$P/env.txt" 2>&1
cat "$P/env.txt"

timeout $(( BUDGET_S + 75 )) $PY benchmarks/peers.py --out "$P" --budget-s "$BUDGET_S" \
    --worker-timeout-s "$JOB_TIMEOUT_S" --keep-traces "${EXTRA[@]}" 2>&1 | tee "$P/run.log"
rc=${PIPESTATUS[0]}
echo "runner exit code $rc after $(( $(date +%s) - START )) s" | tee -a "$P/run.log"
[ -f "$P/peers.md" ] || echo "peers.md missing: the runner did not finish; see run.log and logs/" | tee -a "$P/run.log"

tar -czf "$OUT/peers.tgz" -C "$OUT" peers
if [ "$(stat -c %s "$OUT/peers.tgz")" -gt 15000000 ] && [ -d "$P/traces" ]; then
    echo "archive over 15 MB: traces dropped" | tee -a "$P/run.log"
    rm -rf "$P/traces"
    tar -czf "$OUT/peers.tgz" -C "$OUT" peers
fi
rm -rf "$P"
echo "packed $OUT/peers.tgz ($(stat -c %s "$OUT/peers.tgz") bytes), $(( $(date +%s) - START )) s in all"
