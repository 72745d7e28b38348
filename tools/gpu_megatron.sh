#!/usr/bin/env bash
# Contributor tooling for the project's air-gapped GPU host (docs/contributing/gpu-host.md).
# The megatron-core integration on the GPU machine (issue 5): examples/megatron_gpt.py with and
# without --offload-modules, bitwise loss and parameter comparisons, peak memory, step times.
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#   bash tools/gpu_megatron.sh 1gpu      # one H100: dense and MoE GPT, PP=1; MoE variants
#   bash tools/gpu_megatron.sh 2gpu      # two H200 (nvidia-h200-x2): PP=2, VPP=1 and VPP=2
#   bash tools/gpu_megatron.sh headtohead [ARGS]   # benchmarks/megatron_headtohead.py ARGS, with
#                                        # Transformer Engine from tools/gpu_te.sh (install it first)
#
# headtohead merges its records into the carried docs/results/megatron/headtohead.json, rewrites
# the table in the carried docs/megatron.md and copies both to $OUT/megatron/, with the per-run
# JSON files and logs in one archive per invocation, headtohead_runs_<time>.tgz (a device call
# returns at most 8 files): copy them back into the tree between calls, the JSON files with
# `tar xzf headtohead_runs_<time>.tgz -C docs/results/megatron --wildcards '*.json'` (each
# device call is limited to 10 minutes: run a few jobs per call, e.g. --workloads dense_16k
# --systems offload --graphs none).
#
# Everything lands in $OUT/megatron/ (OUT defaults to ./gpu_out): one JSON per run (<run>.json,
# written by the example), its log (<run>.log), steps.txt (each step's rc and seconds), and
# summary_<mode>.json / summary_<mode>.md (the comparisons; docs/megatron.md quotes them).
# A failing step does not stop the others. Each mode stays under BUDGET_S (270) seconds: the
# essential runs come first, optional ones are skipped when the budget is spent. EXTRA_ARGS
# is appended to every run (e.g. "--layers 4" if time is short).
set -u

MODE=${1:-}
case "$MODE" in 1gpu|2gpu|headtohead) ;; *) echo "usage: bash tools/gpu_megatron.sh 1gpu|2gpu|headtohead [ARGS]" >&2; exit 2 ;; esac
shift

OUT=${OUT:-$PWD/gpu_out}
M=$OUT/megatron
mkdir -p "$M"
PY=${PYTHON:-python3}
export CUBLAS_WORKSPACE_CONFIG=:4096:8   # deterministic cuBLAS, before CUDA starts
STEPS=${STEPS:-22}                       # 2 warm-up steps + 20 measured
START=$(date +%s)
DEADLINE=$(( START + ${BUDGET_S:-270} ))
: > "$M/steps_$MODE.txt"

step() {  # step NAME TIMEOUT_S COMMAND... : output to NAME.log, rc to steps_<mode>.txt
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    local left=$(( DEADLINE - t0 ))
    if [ "$left" -lt 20 ]; then
        printf '%-34s skipped (time budget spent)\n' "$name" | tee -a "$M/steps_$MODE.txt"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout "$limit" "$@" > "$M/$name.log" 2>&1
    local rc=$?
    printf '%-34s rc=%-3s %4ss\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" | tee -a "$M/steps_$MODE.txt"
    return 0
}

read -r -a EXTRA <<< "${EXTRA_ARGS:-}"  # appended to every run, e.g. smaller sizes

ex() {  # ex NAME TIMEOUT_S ARGS... : one run of the example on one GPU
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" $PY examples/megatron_gpt.py --json "$M/$name.json" "$@" "${EXTRA[@]}"
}

ex2() {  # ex2 NAME TIMEOUT_S ARGS... : one run of the example on two GPUs
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/megatron_gpt.py --json "$M/$name.json" "$@" "${EXTRA[@]}"
}

if [ "$MODE" = headtohead ]; then  # before the environment is printed: it imports megatron.core
    if ! [ -f /tmp/tesite/.te_ok ]; then
        echo "Transformer Engine is not installed here: run tools/gpu_te.sh's install calls first (.te/plan.txt)" >&2
        exit 2
    fi
    eval "$(bash tools/gpu_te.sh env)"
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    $PY -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>&1 | tail -1
} > "$M/env_$MODE.txt" 2>&1
cat "$M/env_$MODE.txt"

if [ "$MODE" = headtohead ]; then
    $PY -c "import transformer_engine, megatron.core as m; print('transformer-engine', transformer_engine.__version__, 'megatron-core', m.__version__)" | tee -a "$M/env_$MODE.txt"
    $PY benchmarks/megatron_headtohead.py --runs-dir "$M/headtohead_runs" --reuse "$@"
    rc=$?
    cp docs/results/megatron/headtohead.json docs/results/megatron/headtohead.md docs/megatron.md "$M/" 2>/dev/null
    if [ -d "$M/headtohead_runs" ]; then  # one file for all runs: a device call returns at most 8 files
        archive="$M/headtohead_runs_$(date +%Y%m%d_%H%M%S).tgz"
        tar czf "$archive" -C "$M" headtohead_runs && rm -rf "$M/headtohead_runs" && echo "runs: $archive"
    fi
    echo "headtohead rc=$rc; results under $M"
    exit $rc
fi

DENSE_NAMES=core_attn,fc1,mlp_act,fc2
MOE_NAMES=core_attn,expert_fc1,moe_act,expert_fc2
ALL_MOE=attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,router,expert_fc1,moe_act,expert_fc2

if [ "$MODE" = 1gpu ]; then
    # essential: each model's reference twice (is it reproducible?) and with offloading
    ex gpt_ref        90 --model gpt --steps "$STEPS"
    ex gpt_ref2       90 --model gpt --steps "$STEPS"
    ex gpt_offload    90 --model gpt --steps "$STEPS" --offload-modules="$DENSE_NAMES"
    ex moe_ref        90 --model moe --steps "$STEPS"
    ex moe_ref2       90 --model moe --steps "$STEPS"
    ex moe_offload    90 --model moe --steps "$STEPS" --offload-modules="$MOE_NAMES"
    # which MoE configurations run on this megatron-core (short runs; "sequential" is pinned)
    for v in sequential-alltoall sequential-bias grouped-gemm; do
        ex "moe_variant_$v" 60 --model moe --moe-variant "$v" --steps 4 --warmup-steps 1
    done
    # optional: one name alone, and every MoE name
    ex gpt_offload_core_attn 90 --model gpt --steps "$STEPS" --offload-modules=core_attn
    ex moe_offload_all       90 --model moe --steps "$STEPS" --offload-modules="$ALL_MOE"
    PAIRS="gpt:gpt_ref:gpt_ref2:gpt_offload moe:moe_ref:moe_ref2:moe_offload gpt_core_attn:gpt_ref::gpt_offload_core_attn moe_all:moe_ref::moe_offload_all"
    VARIANTS="moe_ref moe_variant_sequential-alltoall moe_variant_sequential-bias moe_variant_grouped-gemm"
else
    ex2 pp2_vpp1_ref      100 --model gpt --pp 2 --vpp 1 --steps "$STEPS"
    ex2 pp2_vpp1_ref2     100 --model gpt --pp 2 --vpp 1 --steps "$STEPS"
    ex2 pp2_vpp1_offload  100 --model gpt --pp 2 --vpp 1 --steps "$STEPS" --offload-modules="$DENSE_NAMES"
    ex2 pp2_vpp2_ref      100 --model gpt --pp 2 --vpp 2 --steps "$STEPS"
    ex2 pp2_vpp2_ref2     100 --model gpt --pp 2 --vpp 2 --steps "$STEPS"
    ex2 pp2_vpp2_offload  100 --model gpt --pp 2 --vpp 2 --steps "$STEPS" --offload-modules="$DENSE_NAMES"
    # optional: VPP=1 through the interleaved schedule itself (virtual size 1), and MoE
    ex2 pp2_vpp1i_ref         100 --model gpt --pp 2 --vpp 1 --interleaved --steps "$STEPS"
    ex2 pp2_vpp1i_offload     100 --model gpt --pp 2 --vpp 1 --interleaved --steps "$STEPS" --offload-modules="$DENSE_NAMES"
    ex2 moe_pp2_vpp2_ref      100 --model moe --pp 2 --vpp 2 --steps "$STEPS"
    ex2 moe_pp2_vpp2_offload  100 --model moe --pp 2 --vpp 2 --steps "$STEPS" --offload-modules="$MOE_NAMES"
    PAIRS="pp2_vpp1:pp2_vpp1_ref:pp2_vpp1_ref2:pp2_vpp1_offload pp2_vpp2:pp2_vpp2_ref:pp2_vpp2_ref2:pp2_vpp2_offload pp2_vpp1_interleaved:pp2_vpp1i_ref::pp2_vpp1i_offload moe_pp2_vpp2:moe_pp2_vpp2_ref::moe_pp2_vpp2_offload"
    VARIANTS=""
fi

# the comparisons: bitwise (per-microbatch losses as float.hex, and a hash of every trained
# parameter), the reference against itself, peak memory and median step time per rank
timeout 60 $PY - "$M" "$MODE" "$PAIRS" "$VARIANTS" > "$M/summary_$MODE.log" 2>&1 <<'EOF'
import json, sys
from pathlib import Path

out, mode, pairs, variants = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(), sys.argv[4].split()

def load(name):
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if name and p.exists() else None

def same(a, b):
    if not (a and b and a["ok"] and b["ok"]):
        return None
    return a["loss_hex"] == b["loss_hex"] and a["param_sha256"] == b["param_sha256"] and len(a["loss_hex"]) > 0

gib = lambda x: None if x is None else round(x / 2**30, 3)
rows, md = [], []
for pair in pairs:
    label, ref_name, ref2_name, off_name = pair.split(":")
    ref, ref2, off = load(ref_name), load(ref2_name), load(off_name)
    row = {"case": label, "reference": ref_name, "offload": off_name,
           "reference_reproducible": same(ref, ref2) if ref2_name else "not run",
           "bitwise_equal": same(ref, off),
           "offload_modules": off and off.get("offload_modules"),
           "device": (off or ref or {}).get("device"), "megatron_core": (off or ref or {}).get("megatron_core"),
           "steps": (ref or {}).get("steps"),
           "errors": {n: d["per_rank"][0].get("error", "").strip().splitlines()[-1:]
                      for n, d in ((ref_name, ref), (off_name, off)) if d and not d["ok"]}}
    if ref and off and ref["ok"] and off["ok"]:
        row["peak_gib_reference"] = [gib(x) for x in ref["peak_memory_bytes"]]
        row["peak_gib_offload"] = [gib(x) for x in off["peak_memory_bytes"]]
        row["peak_saved_gib"] = [gib(a - b) if None not in (a, b) else None
                                 for a, b in zip(ref["peak_memory_bytes"], off["peak_memory_bytes"])]
        row["median_step_ms_reference"] = [round(x, 2) for x in ref["median_step_time_ms"]]
        row["median_step_ms_offload"] = [round(x, 2) for x in off["median_step_time_ms"]]
        row["step_time_change_pct"] = [round(100 * (b / a - 1), 1) for a, b in zip(ref["median_step_time_ms"], off["median_step_time_ms"])]
        row["offloaded_gib_per_step"] = [gib(sum(s["bytes_offloaded"] for s in r["offload"]["by_name"].values()))
                                         for r in off["per_rank"]]
        row["reloads_on_demand"] = [sum(s["reloads_on_demand"] for s in r["offload"]["by_name"].values())
                                    for r in off["per_rank"]]
        row["final_loss"] = ref["losses"][-1] if ref["losses"] else None
    rows.append(row)
var_rows = []
for name in variants:
    d = load(name)
    var_rows.append({"run": name, "moe_variant": d and d.get("moe_variant"), "ok": bool(d and d["ok"]),
                     "error": ("no JSON: see the log" if d is None else None if d["ok"]
                               else (d["per_rank"][0].get("error") or "").strip().splitlines()[-1:])})
summary = {"mode": mode, "cases": rows, "moe_variants": var_rows}
(out / f"summary_{mode}.json").write_text(json.dumps(summary, indent=1))

md.append(f"# megatron-core integration, {mode}\n")
md.append("| case | device | names | ref reproducible | bitwise equal | peak GiB ref → offload (per rank) | saved GiB | median step ms ref → offload | offloaded GiB/step |")
md.append("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    md.append(f"| {r['case']} | {r['device']} | {','.join(r['offload_modules'] or [])} | {r['reference_reproducible']} | "
              f"{r['bitwise_equal']} | {r.get('peak_gib_reference')} → {r.get('peak_gib_offload')} | {r.get('peak_saved_gib')} | "
              f"{r.get('median_step_ms_reference')} → {r.get('median_step_ms_offload')} | {r.get('offloaded_gib_per_step')} |")
    if r["errors"]:
        md.append(f"|  | errors: {r['errors']} |||||||| ")
if var_rows:
    md.append("\n| MoE variant run | variant | runs | error |\n|---|---|---|---|")
    for v in var_rows:
        md.append(f"| {v['run']} | {v['moe_variant']} | {v['ok']} | {v['error'] or ''} |")
(out / f"summary_{mode}.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
EOF
echo "summary_$MODE rc=$?" >> "$M/steps_$MODE.txt"

echo
echo "== steps ($MODE) =="
cat "$M/steps_$MODE.txt"
echo
cat "$M/summary_$MODE.md" 2>/dev/null || echo "no summary (see $M/summary_$MODE.log)"
echo "total $(( $(date +%s) - START ))s; results under $M"
