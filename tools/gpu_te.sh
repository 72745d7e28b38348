#!/usr/bin/env bash
# Contributor tooling for the project's air-gapped GPU host (docs/contributing/gpu-host.md is the
# recipe; users pip-install TE, docs/te.md): TE 2.20.2 there, from tools/te_fetch.sh's .te/ files.
#
#   bash tools/gpu_te.sh part .te/cu13.part_aa [...]   copy carried files to /tmp/te/ (sha256-checked)
#   bash tools/gpu_te.sh install                      join, check, install to /tmp/tesite, build or
#                                                     unpack the torch extension, check it works
#   bash tools/gpu_te.sh check                        only the checks (import, te.Linear, cpu_offload)
#   eval "$(bash tools/gpu_te.sh env)"                the PYTHONPATH the tests and benchmarks need
#
# Files carried to the machine arrive in the working tree (.te/...), which is laid anew for each
# call; /tmp/te/ stays while the machine is warm (calls within ~30 s of each other), so the parts
# of the 276.5 MB core wheel arrive over several calls and are joined by `install`.
# `install` is idempotent: it returns at once if /tmp/tesite already imports. It writes its log
# and timings to $OUT/te/ (OUT defaults to ./gpu_out).
#
# The torch extension (transformer-engine-torch, source only): if the bundle holds one compiled
# on the CPU machine (te_fetch.sh --prebuild) for exactly this torch, it is unpacked; otherwise,
# or with TE_BUILD=1, it is compiled here in the foreground: a C++-only extension (33 files, no
# nvcc), with ninja from the bundle so that MAX_JOBS (default: all cores) run in parallel, and
# NVTE_PYTORCH_FORCE_BUILD=TRUE so that its setup does not first try to download a prebuilt
# wheel from GitHub (unreachable here).
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAGE=/tmp/te
SITE=/tmp/tesite
OUT=${OUT:-$PWD/gpu_out}
LOGDIR=$OUT/te
CMD=${1:-}
shift || true

site_packages() { "$PY" -c "import sysconfig; print(sysconfig.get_path('purelib'))"; }

pythonpath() {
    local p=$SITE
    [ -d /tmp/site ] && p=$p:/tmp/site
    echo "$p:$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

cmd_part() {
    [ $# -gt 0 ] || { echo "usage: gpu_te.sh part FILE..." >&2; exit 2; }
    mkdir -p "$STAGE"
    local src
    for src in "$@"; do
        [ -f "$src" ] || { echo "not carried: $src (name it in the call's carry list)" >&2; exit 1; }
        cp "$src" "$STAGE/"
        local sums
        sums=$(dirname "$src")/SHA256SUMS
        [ -f "$sums" ] && cp "$sums" "$STAGE/SHA256SUMS"
        if [ -f "$STAGE/SHA256SUMS" ]; then
            local name want got
            name=$(basename "$src")
            want=$(awk -v n="$name" '$2 == n {print $1}' "$STAGE/SHA256SUMS")
            got=$(sha256sum "$STAGE/$name" | cut -d' ' -f1)
            if [ -n "$want" ] && [ "$want" != "$got" ]; then
                echo "sha256 mismatch for $name" >&2
                exit 1
            fi
            echo "part $name: $(stat -c %s "$STAGE/$name") bytes${want:+, sha256 ok}"
        fi
    done
    ls -l "$STAGE" | tail -n +2
}

run_checks() {  # the checks of step 5 of GPU.md's recipe, and what the tests need to know
    PYTHONPATH=$(pythonpath) "$PY" - <<'EOF'
import os, sys, time
t0 = time.perf_counter()
import torch
import transformer_engine
import transformer_engine.pytorch as te
from transformer_engine.pytorch import cpu_offload
from transformer_engine.pytorch.cpu_offload import get_cpu_offload_context
from importlib import metadata
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch", "pydantic", "onnx",
             "onnxscript", "einops", "nvidia-cudnn-cu13", "nvidia-cudnn-frontend"):
    try:
        print(f"  {name:26s} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"  {name:26s} not installed")
print("import transformer_engine.pytorch: %.1f s" % (time.perf_counter() - t0))
print("transformer_engine from", os.path.dirname(transformer_engine.__file__))
print("cudnn", te.get_cudnn_version(), "device", torch.cuda.get_device_name(),
      "capability", torch.cuda.get_device_capability())
for what, fn in (("fp8 (delayed/current scaling)", te.is_fp8_available),
                 ("mxfp8", te.is_mxfp8_available)):
    ok, reason = fn(return_reason=True)
    print(f"{what}: {'available' if ok else 'not available: ' + reason}")
torch.manual_seed(0)
lin = te.Linear(256, 512, params_dtype=torch.bfloat16)
x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y = lin(x)
y.float().square().sum().backward()
ref = x.detach().float() @ lin.weight.detach().float().t() + lin.bias.detach().float()
err = (y.float() - ref).abs().max().item()
assert torch.isfinite(x.grad).all() and lin.weight.grad is not None and err < 0.1, err
print(f"te.Linear forward+backward: ok (max |y - x W^T - b| = {err:.3g})")
print("transformer_engine.pytorch.cpu_offload: ok (get_cpu_offload_context, v1 path:",
      cpu_offload.NVTE_CPU_OFFLOAD_V1, ")")
EOF
}

timed() {  # timed NAME COMMAND...: run it (errexit on), record its seconds; returns its status
    local name=$1
    shift
    local t0=$SECONDS rc
    echo "== $name"
    set +e
    ( set -e; "$@" )
    rc=$?
    set -e
    printf '%-30s %5d s%s\n' "$name" "$(( SECONDS - t0 ))" "$([ "$rc" = 0 ] || echo " (exit $rc)")" | tee -a "$LOGDIR/timings.txt"
    return $rc
}

join_and_verify() {
    for f in .te/cu13.part_* .te/te_bundle.tar .te/SHA256SUMS; do  # carried in this very call
        [ -f "$f" ] && cp "$f" "$STAGE/"
    done
    [ -f "$STAGE/SHA256SUMS" ] || { echo "missing $STAGE/SHA256SUMS: carry .te/SHA256SUMS" >&2; exit 1; }
    local wheel
    wheel=$(awk '$2 ~ /^wheel_cu13\// {print $2}' "$STAGE/SHA256SUMS")
    if ! ( cd "$STAGE" && grep -v "cu13.part_" SHA256SUMS | sha256sum --quiet -c - 2>/dev/null ); then
        local missing=""
        for p in $(awk '$2 ~ /^cu13\.part_/ {print $2}' "$STAGE/SHA256SUMS") te_bundle.tar; do
            [ -f "$STAGE/$p" ] || missing="$missing $p"
        done
        [ -z "$missing" ] || { echo "missing in $STAGE (carry them in earlier calls):$missing" >&2; exit 1; }
        mkdir -p "$STAGE/wheel_cu13"
        cat "$STAGE"/cu13.part_* > "$STAGE/$wheel"
        ( cd "$STAGE" && grep -v "cu13.part_" SHA256SUMS | sha256sum -c - )
    fi
    rm -f "$STAGE"/cu13.part_*  # the joined wheel replaces them (disk)
    rm -rf "$STAGE/b" && mkdir -p "$STAGE/b"
    tar -xf "$STAGE/te_bundle.tar" -C "$STAGE/b"
}

install_wheels() {
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" \
        "$STAGE"/wheel_cu13/*.whl "$STAGE"/b/wheels/required/*.whl
    # Wheels installed only where the machine's own Python lacks the module (no shadowing).
    local extra=()
    "$PY" -c "import onnx, onnxscript" 2>/dev/null || extra+=(onnx- onnxscript- onnx_ir- ml_dtypes- protobuf-)
    "$PY" -c "import importlib_metadata" 2>/dev/null || extra+=(importlib_metadata- zipp-)
    "$PY" -c "import packaging" 2>/dev/null || extra+=(packaging-)
    "$PY" -c "import cudnn" 2>/dev/null || extra+=(nvidia_cudnn_frontend-)
    local files=() prefix
    for prefix in "${extra[@]}"; do
        files+=("$STAGE"/b/wheels/if_missing/"$prefix"*.whl)
    done
    if [ ${#files[@]} -gt 0 ]; then
        echo "not on the machine, installed from the bundle: ${extra[*]}"
        "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "${files[@]}"
    fi
}

build_extension() {
    local torch_version
    torch_version=$("$PY" -c "import torch; print(torch.__version__)")
    if [ "${TE_BUILD:-0}" != 1 ] && [ -f "$STAGE/b/te_torch_ext.tgz" ]; then
        rm -rf "$STAGE/ext" && mkdir -p "$STAGE/ext"
        tar -xzf "$STAGE/b/te_torch_ext.tgz" -C "$STAGE/ext"
        if [ "$(cat "$STAGE/ext/BUILT_FOR_TORCH")" = "$torch_version" ]; then
            rm "$STAGE/ext/BUILT_FOR_TORCH"
            cp -r "$STAGE/ext/." "$SITE/"
            touch "$STAGE/ext/.prebuilt"
            echo "torch extension: prebuilt on the CPU machine for torch $torch_version, unpacked"
            return 0
        fi
        echo "the prebuilt extension is for torch $(cat "$STAGE/ext/BUILT_FOR_TORCH"), this is $torch_version: building"
    fi
    rm -f "$STAGE/ext/.prebuilt"
    local sp tools ninja_bin
    sp=$(site_packages)
    tools=$STAGE/buildtools
    rm -rf "$tools" "$STAGE/src" /tmp/tesite2
    "$PY" -m pip install -q --no-index --no-deps --target "$tools" "$STAGE"/b/wheels/build/ninja-*.whl
    local pypath=""
    if ! "$PY" -c "import setuptools, wheel.bdist_wheel" 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --target "$tools/py" \
            "$STAGE"/b/wheels/build/setuptools-*.whl "$STAGE"/b/wheels/build/wheel-*.whl
        pypath=$tools/py
    fi
    ninja_bin=$(dirname "$(find "$tools" -name ninja -type f -perm -u+x | head -1)")  # $tools/bin/ninja
    PATH=$ninja_bin:$PATH ninja --version > /dev/null || { echo "no ninja from the bundle" >&2; exit 1; }
    mkdir -p "$STAGE/src"
    tar -xzf "$STAGE/b/te_torch_src.tgz" -C "$STAGE/src"
    ( cd "$STAGE/src/te_torch_src" &&
      PATH=$ninja_bin:$PATH PYTHONPATH=$pypath CUDA_HOME=/usr/local/cuda NVTE_FRAMEWORK=pytorch \
      NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
      CPATH=$sp/nvidia/cudnn/include:$sp/nvidia/nccl/include:$sp/nvidia/cu13/include \
      "$PY" -m pip install -v --no-index --no-build-isolation --no-deps --target /tmp/tesite2 . \
      > "$LOGDIR/build.log" 2>&1 ) || { tail -40 "$LOGDIR/build.log"; exit 1; }
    grep -c "^\s*\[[0-9]*/[0-9]*\]" "$LOGDIR/build.log" | sed 's/^/ninja steps: /' || true
    cp -r /tmp/tesite2/. "$SITE/"
}

cmd_install() {
    mkdir -p "$LOGDIR" "$STAGE"
    if [ -f "$SITE/.te_ok" ] && PYTHONPATH=$(pythonpath) "$PY" -c "import transformer_engine.pytorch" 2>/dev/null; then
        echo "Transformer Engine already installed in $SITE (rm $SITE/.te_ok to reinstall)"
        return 0
    fi
    : > "$LOGDIR/timings.txt"
    local t0=$SECONDS
    {
        timed "join parts + sha256" join_and_verify
        timed "pip install wheels" install_wheels
        timed "torch extension" build_extension
        if ! timed "checks" run_checks; then
            # A prebuilt extension that does not load here (it should: same torch build) is
            # replaced by one compiled here, in the same call.
            [ -f "$STAGE/ext/.prebuilt" ] || exit 1
            echo "the prebuilt torch extension failed the checks: compiling it here"
            rm -rf "$SITE"/transformer_engine/wheel_lib/transformer_engine_torch* "$SITE"/transformer_engine_torch-*
            TE_BUILD=1 timed "torch extension (build)" build_extension
            timed "checks" run_checks
        fi
        touch "$SITE/.te_ok"
        printf '%-30s %5d s\n' "install total" "$(( SECONDS - t0 ))" | tee -a "$LOGDIR/timings.txt"
        du -sh "$SITE" | sed 's/^/installed: /'
    } 2>&1 | tee "$LOGDIR/install.log"
    [ "${PIPESTATUS[0]}" = 0 ] && [ -f "$SITE/.te_ok" ]
}

case "$CMD" in
    part) cmd_part "$@" ;;
    install) cmd_install ;;
    check) mkdir -p "$LOGDIR"; run_checks 2>&1 | tee "$LOGDIR/check.log" ;;
    env) echo "export PYTHONPATH=$(pythonpath)" ;;
    *) sed -n '2,22p' "$0"; exit 2 ;;
esac
