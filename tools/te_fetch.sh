#!/usr/bin/env bash
# Contributor tooling for the project's air-gapped GPU host (no package registry there; users
# pip-install TE, docs/te.md): runs on the CPU machine and fills the ignored folder .te/ with what
# tools/gpu_te.sh installs there. docs/contributing/gpu-host.md is the recipe and quotes its timings.
#
#   bash tools/te_fetch.sh              # wheels, the extension's source, bundle, parts, sums, plan
#   bash tools/te_fetch.sh --prebuild   # the same, and also compile the torch extension here
#
# What lands in .te/ (nothing of it is committed: .te/ is in .gitignore):
#   wheels/                 the small wheels (TE's Python package, pydantic & co, onnx & co, ninja,
#                           setuptools/wheel for the build), downloaded for cp312 manylinux x86_64
#   te_torch_src.tgz        transformer-engine-torch 2.20.2's source tree (the torch extension is
#                           source-only; its metadata step fails here, but pip leaves the tree)
#   te_torch_ext.tgz        (--prebuild) the extension compiled here against torch 2.11.0+cu130,
#                           the GPU machine's torch (pip serves that exact build), Python 3.12
#   te_bundle.tar           everything above in one file
#   cu13.part_aa, _ab, ...  transformer-engine-cu13 (the 276.5 MB core library) in parts of
#                           PART_MIB (52) MiB: one device call carries at most 64 MiB, the tree included
#   SHA256SUMS              sums of the whole cu13 wheel, the bundle and every part
#   timings.txt             seconds per step of the last run
#   plan.txt                the device calls to make, in order (printed at the end too)
#
# Environment: PYTHON (default python3) runs pip; PY312 is the Python 3.12 used by --prebuild
# (default: pyenv's 3.12, else python3.12); PART_MIB; TE_DIR (default .te: the device calls carry
# it, so it must be an ignored folder inside the repository).
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
TE_VERSION=2.20.2
TORCH_VERSION=2.11.0          # the GPU machine's torch (2.11.0+cu130)
PYTHON=${PYTHON:-python3}
PART_MIB=${PART_MIB:-52}
CARRY_MIB=56                  # what one device call may carry: 64 MiB less room for the working tree (about 5 MiB)
D=${TE_DIR:-.te}
PREBUILD=0
for arg in "$@"; do
    case "$arg" in
        --prebuild) PREBUILD=1 ;;
        -h|--help) sed -n "2,25p" "$0"; exit 0 ;;
        *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done

# Runtime needs (Requires-Dist of transformer-engine-cu13: pydantic, importlib-metadata,
# packaging; of the torch extension's setup: einops, onnx, onnxscript, packaging, pydantic,
# nvdlfw-inspect, nvidia-cudnn-frontend), pinned to what resolved on 2026-11-23.
# transformer_engine.pytorch imports einops, pydantic and (through export.py) onnx and
# onnxscript at import time. Not fetched: nvdlfw-inspect (TE's debug features only) and
# nvidia-cudnn-frontend's own dependencies (nvidia-cutlass-dsl, 180 MB: SM100 kernels only).
REQUIRED=(
    "transformer-engine==$TE_VERSION"
    "pydantic==2.14.3" "pydantic-core==2.50.4" "annotated-types==0.8.0" "typing-inspection==0.4.5"
    "typing-extensions==4.16.0" "einops==0.8.2"
)
# Installed on the GPU machine only where its own site-packages lacks them (tools/gpu_te.sh):
IF_MISSING=(
    "importlib-metadata==10.2.0" "zipp==4.1.2" "packaging==26.3"
    "onnx==1.23.2" "onnxscript==0.7.2" "onnx-ir==1.1.0" "ml-dtypes==0.6.0" "protobuf==7.36.2"
    "nvidia-cudnn-frontend==1.32.0"
)
# For the build of the torch extension there: ninja makes it parallel (without it setuptools
# compiles the 33 files one after the other); setuptools/wheel/pybind11 only if missing.
BUILD_TOOLS=("ninja==1.13.2" "setuptools==81.0.0" "wheel==0.48.0")
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64)

mkdir -p "$D"
: > "$D/timings.txt"
T0=$(date +%s)
step() {  # step NAME COMMAND...: run it, record its seconds in timings.txt
    local name=$1
    shift
    local t0 t1
    t0=$(date +%s.%N)
    echo "== $name"
    "$@"
    t1=$(date +%s.%N)
    printf '%-28s %7.1f s\n' "$name" "$(echo "$t1 - $t0" | bc)" | tee -a "$D/timings.txt"
}
quiet_pip() {  # pip prints a warning per package for this machine's extra (absent) indexes
    "$PYTHON" -m pip "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
}

fetch_wheels() {
    rm -rf "$D/wheels" "$D/wheel_cu13"
    mkdir -p "$D/wheels/required" "$D/wheels/if_missing" "$D/wheels/build" "$D/wheel_cu13"
    quiet_pip download -q --no-deps "${PLATFORM[@]}" -d "$D/wheel_cu13" "transformer-engine-cu13==$TE_VERSION"
    quiet_pip download -q --no-deps "${PLATFORM[@]}" -d "$D/wheels/required" "${REQUIRED[@]}"
    quiet_pip download -q --no-deps "${PLATFORM[@]}" -d "$D/wheels/if_missing" "${IF_MISSING[@]}"
    quiet_pip download -q --no-deps "${PLATFORM[@]}" -d "$D/wheels/build" "${BUILD_TOOLS[@]}"
    local want=$(( ${#REQUIRED[@]} + ${#IF_MISSING[@]} + ${#BUILD_TOOLS[@]} ))
    local got
    got=$(find "$D/wheels" -name '*.whl' | wc -l)
    [ "$got" -eq "$want" ] || { echo "expected $want wheels, got $got" >&2; exit 1; }
    ls "$D/wheel_cu13"/transformer_engine_cu13-"$TE_VERSION"-*.whl > /dev/null
}

fetch_source() {
    # pip download unpacks the sdist, then fails in its metadata step (setup.py reads
    # torch.version.cuda, None on a CPU build of torch); --no-clean keeps the unpacked tree.
    local tmp
    tmp=$(mktemp -d)
    TMPDIR=$tmp "$PYTHON" -m pip download --no-clean --no-deps --no-build-isolation \
        --no-binary transformer-engine-torch -d "$tmp/dl" "transformer-engine-torch==$TE_VERSION" \
        > "$tmp/pip.log" 2>&1 || true
    local src
    src=$(find "$tmp" -maxdepth 2 -type d -name 'transformer-engine-torch_*' | head -1)
    if [ -z "$src" ] || [ ! -f "$src/setup.py" ]; then
        tail -20 "$tmp/pip.log" >&2
        echo "the source tree of transformer-engine-torch was not left behind" >&2
        exit 1
    fi
    grep -q "^Version: $TE_VERSION$" "$src/PKG-INFO"
    rm -rf "$src/transformer_engine_torch.egg-info" "$src/build"
    rm -rf "$tmp/te_torch_src" && mv "$src" "$tmp/te_torch_src"
    tar -czf "$D/te_torch_src.tgz" -C "$tmp" te_torch_src
    rm -rf "$tmp"
}

prebuild() {
    # Compile the extension here, against the very torch the GPU machine has: pip serves
    # torch 2.11.0+cu130 (4.6 GB with its CUDA packages, headers included). The extension is
    # C++ only (a CppExtension: no nvcc), so a machine without a GPU compiles it.
    local py312=${PY312:-}
    if [ -z "$py312" ]; then
        py312=$(ls -d "$HOME"/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null | tail -1 || true)
        [ -n "$py312" ] || py312=$(command -v python3.12)
    fi
    local venv=${TE_BUILD_VENV:-/tmp/te-build-venv}
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c \
        "import torch, sys; sys.exit(torch.__version__ != '$TORCH_VERSION+cu130')" 2>/dev/null; then
        rm -rf "$venv"
        "$py312" -m venv "$venv"
        "$venv/bin/python" -m pip install -q "torch==$TORCH_VERSION" wheel setuptools ninja packaging 2>&1 \
            | grep -v "is ignored: it is neither a file nor a directory" || true
    fi
    "$venv/bin/python" -c "import torch; assert torch.version.cuda == '13.0', torch.version.cuda"
    local sp
    sp=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    local work
    work=$(mktemp -d)
    tar -xzf "$D/te_torch_src.tgz" -C "$work"
    ( cd "$work/te_torch_src" &&
      PATH=$venv/bin:$PATH CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} NVTE_FRAMEWORK=pytorch \
      NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=$(nproc) \
      CPATH=$sp/nvidia/cudnn/include:$sp/nvidia/nccl/include:$sp/nvidia/cu13/include \
      "$venv/bin/python" -m pip install -q --no-index --no-build-isolation --no-deps \
          --target "$work/out" . > "$work/build.log" 2>&1 ) || { tail -30 "$work/build.log" >&2; exit 1; }
    find "$work/out" -name 'transformer_engine_torch*.so' | grep -q . || { echo "no extension built" >&2; exit 1; }
    "$venv/bin/python" -c "import torch; print(torch.__version__)" > "$work/out/BUILT_FOR_TORCH"
    tar -czf "$D/te_torch_ext.tgz" -C "$work/out" .
    rm -rf "$work"
}

bundle() {
    rm -f "$D/te_bundle.tar"
    local items=(wheels te_torch_src.tgz)
    [ -f "$D/te_torch_ext.tgz" ] && items+=(te_torch_ext.tgz)
    tar -cf "$D/te_bundle.tar" -C "$D" "${items[@]}"
}

split_parts() {
    rm -f "$D"/cu13.part_*
    split -b "${PART_MIB}M" -a 2 "$D"/wheel_cu13/transformer_engine_cu13-*.whl "$D/cu13.part_"
    ( cd "$D" && sha256sum wheel_cu13/transformer_engine_cu13-*.whl te_bundle.tar cu13.part_* > SHA256SUMS )
}

plan() {
    # Group the parts, then the bundle, into device calls of at most CARRY_MIB; every call also
    # carries SHA256SUMS (a part is checked as soon as it arrives). The last call installs.
    local files=("$D"/cu13.part_* "$D/te_bundle.tar")
    local calls=() cur="" cur_bytes=0 limit=$(( CARRY_MIB << 20 )) f size
    for f in "${files[@]}"; do
        size=$(stat -c %s "$f")
        if [ -n "$cur" ] && [ $(( cur_bytes + size )) -gt "$limit" ]; then
            calls+=("$cur")
            cur="" cur_bytes=0
        fi
        cur="${cur:+$cur }$f"
        cur_bytes=$(( cur_bytes + size ))
    done
    calls+=("$cur")
    {
        echo "# Device calls to install TE $TE_VERSION on a fresh GPU machine, back to back (each"
        echo "# within ~30 s of the previous one, or the machine and /tmp/te are gone)."
        local n=${#calls[@]} i=0 c carry cmd
        for c in "${calls[@]}"; do
            i=$(( i + 1 ))
            carry=$(printf '"%s", ' $c "$D/SHA256SUMS")
            cmd="bash tools/gpu_te.sh part $c"
            [ "$i" -eq "$n" ] && cmd="$cmd && bash tools/gpu_te.sh install"
            echo "call $i/$n: carry [${carry%, }]"
            echo "  command: $cmd"
        done
        echo "# then, in every later call of the same warm machine:"
        echo "#   eval \"\$(bash tools/gpu_te.sh env)\"; <your command>"
    } > "$D/plan.txt"
}

step "wheels (pip download)" fetch_wheels
step "torch extension source" fetch_source
if [ "$PREBUILD" = 1 ]; then
    step "prebuild torch extension" prebuild
else
    rm -f "$D/te_torch_ext.tgz"
fi
step "bundle" bundle
step "split + sha256" split_parts
step "plan" plan
printf '%-28s %7d s\n' "total" "$(( $(date +%s) - T0 ))" | tee -a "$D/timings.txt"
echo
ls -l "$D"/te_bundle.tar "$D"/cu13.part_* | awk '{printf "%10.1f MiB  %s\n", $5/1048576, $9}'
echo
cat "$D/plan.txt"
