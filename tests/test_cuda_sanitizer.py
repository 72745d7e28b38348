"""Offloading steps under PyTorch's CUDA stream sanitizer (CSAN). Skipped without CUDA.

Run on the GPU machine with ``python -m pytest -q tests/test_cuda_sanitizer.py``.

The sanitizer (`torch.cuda._sanitizer`) records, for every kernel launched through the
dispatcher, which CUDA tensors it reads and writes on which stream, and follows the events
and stream waits between streams; a kernel that touches a tensor without an event edge from
the stream that last wrote it (or, for a write, from the streams that read it since) raises
``CUDASanitizerErrors`` ("detected N errors") after printing each race ("CSAN detected a
possible data race ..."). It installs a `TorchDispatchMode` for the whole process, cannot be
switched off cleanly, and must be on before the tensors exist, so each test runs this file as
a fresh process with ``TORCH_CUDA_SANITIZER=1`` (which enables it at ``import torch``):

* ``control``: a tensor written on the default stream and read on a side stream without
  ``wait_stream`` must be reported (the sanitizer is active), and the same read after a
  ``wait_stream`` must not;
* ``steps``: training steps of a 4-layer stack with four names offloaded (four plain steps,
  then two with slowed copy streams), each followed by ``end_iteration()``: bytes go out and
  come back, gradients are bitwise equal to a reference without offloading, and the
  sanitizer reports nothing, having seen kernels on both copy streams; ``regions``,
  ``checkpointed`` and ``gapped`` are the same steps through graphed-callable regions run
  eagerly, checkpointed layers, and a GLU that saves half its input (`_steps`).

What the sanitizer can and cannot see: it keys accesses by the data pointer of each tensor
argument, so it checks the engine's copies (whole storages, from their first byte) against
the compute kernels that wrote or read those storages, in forward and in backward (the
autograd threads inherit the dispatch mode). Reuse of freed memory is not checked: a free
forgets the pointer's history. Nor host memory: only CUDA tensors are tracked, so rule 3 of
docs/design.md (the H2D copy reads a pinned buffer only after the D2H copy wrote it) and the
pinned pool's reuse edge are invisible to it. The bitwise gradient comparison covers those.
Seen on an H100 (torch 2.11): deleting the wait of rule 1, 2 or 4 makes ``steps`` report a
race; deleting rule 3's does not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()


def _conftest():
    """tests/conftest.py, loaded from its file: in a whole-suite run another conftest.py
    (tests/integrations/) can hold the name ``conftest``, and the subprocess has neither."""
    import importlib.util

    name = "_offload_tests_conftest"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, SCRIPT.with_name("conftest.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


requires_cuda = _conftest().requires_cuda

NAMES = ["qkv_linear", "core_attn", "attn_proj", "fc1"]
MODES = ("steps", "regions", "checkpointed", "gapped")
PLAIN_STEPS, SLOW_STEPS = 4, 2
SPIN_CYCLES = 2_000_000  # about a millisecond of a spinning kernel before each copy
TIMEOUT_S = 300


# ---------------------------------------------------------------------------------------------
# The subprocess (this file run as a script, with TORCH_CUDA_SANITIZER=1)


def _sanitizer():
    """The sanitizer's module, checked to be enabled (by TORCH_CUDA_SANITIZER at import)."""
    import torch.cuda._sanitizer as csan

    if not csan.cuda_sanitizer.enabled:
        raise SystemExit("SANITIZER-FAIL: the CUDA sanitizer is not enabled (TORCH_CUDA_SANITIZER unset?)")
    return csan


def _control() -> int:
    """A read on a side stream of a tensor written on the default stream: ordered by a
    ``wait_stream`` it passes; without one the sanitizer must report it."""
    csan = _sanitizer()
    side = torch.cuda.Stream()
    a = torch.ones(1 << 20, device="cuda")  # written on the default stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a.mul(2)  # ordered after the write: no report
    print("SANITIZER-CONTROL ordered read passed", flush=True)
    b = torch.ones(1 << 20, device="cuda")  # written on the default stream, after the wait
    try:
        with torch.cuda.stream(side):
            b.mul(2)  # no event edge from the default stream since b was written: a race
    except csan.CUDASanitizerErrors as e:
        print(f"SANITIZER-CONTROL detected={len(e.errors)} ({e})", flush=True)
        return 0
    print("SANITIZER-FAIL: the deliberate race was not reported", flush=True)
    return 1


def _steps(mode: str = "steps") -> int:
    """Offloading steps under the sanitizer. ``regions``: each layer runs as an
    ``offload.graphs`` graphed-callable region, eagerly: the warm-up that plans a capture.
    ``checkpointed``: each layer runs under the planner's checkpointing with its inputs
    offloaded (the "memory-free" layer), whose group signals when its backward starts (Note [2]
    of offload/regions.py), so the layer below reloads under this layer's recompute.
    ``gapped``: the MLP's activation saves only the first half of its input, a view with gaps
    (`GateOnlyGLU` of tests/conftest.py), and ``mlp_act`` is offloaded too: its rows come back
    packed and are spread on the compute stream at their unpack (Note [10] of offload.copy_queue)."""
    regions = mode == "regions"
    import collections
    import copy

    import offload
    from offload.testing import GPT_MAPPING, build_gpt, first_difference, slow_copy_streams, train_step

    csan = _sanitizer()
    # Count what the sanitizer analyses, per stream, and every race it finds (also one whose
    # exception something might swallow): wrap its per-kernel entry point.
    handler = csan.cuda_sanitizer.dispatch.event_handler
    analyse = handler._handle_kernel_launch
    kernels: collections.Counter = collections.Counter()
    races: list = []

    def counted(stream, *args, **kwargs):
        found = analyse(stream, *args, **kwargs)
        kernels[stream] += 1
        races.extend(found)
        return found

    handler._handle_kernel_launch = counted

    torch.use_deterministic_algorithms(True)
    hidden, heads, layers, seq, batch = 256, 4, 4, 2048, 1
    model = build_gpt(hidden, heads, layers, device="cuda")
    names = NAMES
    if mode == "gapped":
        model = _conftest().with_gate_only_glu(model)
        names = NAMES + ["mlp_act"]
    ref_model = copy.deepcopy(model)

    def inputs(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(seq, batch, hidden, device="cuda", generator=g)
        return x, torch.randn(seq, batch, hidden, device="cuda", generator=g)

    x, g = inputs(0)
    _, ref_a = train_step(ref_model, x, g)
    _, ref_b = train_step(ref_model, x, g)
    diff = first_difference(ref_a, ref_b)
    if diff is not None:
        print(f"SANITIZER-FAIL: the reference itself is not reproducible: {diff}", flush=True)
        return 1

    if mode == "checkpointed":
        from offload.planner.apply import checkpoint_modules

        layer_names = [f"layers.{i}" for i in range(layers)]
        checkpoint_modules(model, layer_names)
        manager = offload.configure(["layers"], device="cuda", min_tensor_bytes=1024)
        offload.attach(model, {"layers": layer_names})
    else:
        manager = offload.configure(names, device="cuda", min_tensor_bytes=1024)
        offload.attach(model, GPT_MAPPING)
    if regions:  # the model's forward through per-layer regions (same modules, same parameters)
        fns = [offload.graphs._as_region(layer, ("layer", i)) for i, layer in enumerate(model.layers)]

        def forward(h):
            for fn in fns:
                h = fn(h)
            return model.final_layernorm(h)

        model.forward = forward
    d2h, h2d = manager.streams.d2h.cuda_stream, manager.streams.h2d.cuda_stream

    monkeypatch = pytest.MonkeyPatch()
    offloaded = reloaded = 0
    try:
        for step in range(PLAIN_STEPS + SLOW_STEPS):
            variant = "plain" if step < PLAIN_STEPS else "slow_copies"
            if step == PLAIN_STEPS:
                slow_copy_streams(monkeypatch, SPIN_CYCLES)
            x, g = inputs(step + 1)
            ref_out, ref = train_step(ref_model, x, g)
            out, got = train_step(model, x, g)
            total = offload.end_iteration().total()
            diff = "outputs differ" if not torch.equal(out, ref_out) else first_difference(ref, got)
            print(
                f"step {step} ({variant}): offloaded={total.bytes_offloaded} reloaded={total.bytes_reloaded} "
                f"on_demand={total.reloads_on_demand} gradients={'bitwise equal' if diff is None else diff}",
                flush=True,
            )
            if diff is not None:
                print(f"SANITIZER-FAIL: step {step} ({variant}): {diff}", flush=True)
                return 1
            if total.bytes_offloaded <= 0 or total.bytes_reloaded <= 0:
                print(f"SANITIZER-FAIL: step {step} ({variant}) offloaded or reloaded nothing", flush=True)
                return 1
            offloaded += total.bytes_offloaded
            reloaded += total.bytes_reloaded
    finally:
        monkeypatch.undo()
    torch.cuda.synchronize()

    summary = (
        f"offloaded={offloaded} reloaded={reloaded} kernels={sum(kernels.values())} "
        f"d2h_kernels={kernels[d2h]} h2d_kernels={kernels[h2d]} races={len(races)}"
    )
    if races:
        print(f"SANITIZER-FAIL: {summary}", flush=True)
        return 1
    if kernels[d2h] == 0 or kernels[h2d] == 0:
        print(f"SANITIZER-FAIL: the sanitizer saw no copy on a copy stream: {summary}", flush=True)
        return 1
    if regions and not manager.captures.plans:
        print("SANITIZER-FAIL: no region ran", flush=True)
        return 1
    print(f"SANITIZER-OK {mode} steps={PLAIN_STEPS + SLOW_STEPS} {summary}", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The tests


def _text(out) -> str:
    if out is None:
        return ""
    return out.decode(errors="replace") if isinstance(out, bytes) else out


def _report(stdout, stderr, limit: int = 6000) -> str:
    return f"\n--- stdout (tail) ---\n{_text(stdout)[-limit:]}\n--- stderr (tail) ---\n{_text(stderr)[-limit:]}"


def _run_sanitized(mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["TORCH_CUDA_SANITIZER"] = "1"
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    try:
        return subprocess.run(
            [sys.executable, str(SCRIPT), mode], cwd=ROOT, env=env,
            capture_output=True, text=True, timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"sanitized {mode!r} run timed out after {TIMEOUT_S} s{_report(e.stdout, e.stderr)}")


@requires_cuda
def test_sanitizer_reports_a_deliberate_race():
    """Positive control: the sanitizer is active in the subprocess and reports a missing
    event edge (and accepts the same access once ordered)."""
    proc = _run_sanitized("control")
    report = _report(proc.stdout, proc.stderr)
    assert proc.returncode == 0, f"control exited with {proc.returncode}{report}"
    assert "SANITIZER-CONTROL ordered read passed" in proc.stdout, report
    assert "SANITIZER-CONTROL detected=" in proc.stdout, report
    assert "CSAN detected a possible data race" in proc.stderr, report


@requires_cuda
@pytest.mark.parametrize("mode", MODES)
def test_offloading_steps_are_race_free_under_the_sanitizer(mode):
    """``steps``: eager offloading steps. ``regions``: the same steps with every layer an
    ``offload.graphs`` region run eagerly, the warm-up whose plan a capture repeats (a capture
    itself runs no kernel the sanitizer could see). ``checkpointed``: checkpointed layers whose
    inputs are offloaded, each reloading the one below from the start of its backward.
    ``gapped``: a GLU that saves half its input, whose rows are spread where they are unpacked."""
    proc = _run_sanitized(mode)
    report = _report(proc.stdout, proc.stderr)
    assert "CSAN detected" not in proc.stderr, f"the sanitizer reported a race{report}"
    assert proc.returncode == 0, f"sanitized steps exited with {proc.returncode}{report}"
    ok = [line for line in proc.stdout.splitlines() if line.startswith("SANITIZER-OK")]
    assert ok, f"no SANITIZER-OK line{report}"
    print(ok[-1])


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("control", *MODES):
        raise SystemExit(f"usage: TORCH_CUDA_SANITIZER=1 {sys.argv[0]} control|{'|'.join(MODES)}")
    sys.exit(_control() if sys.argv[1] == "control" else _steps(sys.argv[1]))
