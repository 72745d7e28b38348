"""Test-only patches that let megatron-core run a small GPT on the CPU (gloo).

megatron-core assumes CUDA in a few places that a CPU test reaches. These test-only patches
(applied by the conftest for the test module and undone after it, and in the ranks of
``run_example``) make a small GPT and a small MoE GPT run forward and backward on the
CPU; none of them changes what the model computes:

1. ``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffer on CUDA: allocate on the CPU.
2. ``CudaRNGStatesTracker.fork`` (dropout regions) needs CUDA RNG states: run the region as is
   (the tests use no dropout); recompute's RNG save/restore uses the CPU generator.
3. MoE: ``TopKRouter.gating`` moves its weight to ``torch.cuda.current_device()``: the current
   device is the CPU. megatron-core 0.16 without Transformer Engine leaves ``te_general_gemm``
   undefined in ``moe_utils`` (a NameError in the router): define it as ``None`` (0.19 does).
4. The schedules count tokens in ``torch.zeros([], device="cuda")``: their ``torch`` is a proxy
   whose ``zeros`` puts ``device="cuda"`` on the CPU.
5. Pipelining only (the workers): the point-to-point exchange calls ``torch.cuda.synchronize()``
   after its sends and receives; gloo's are complete when they return, so it is a no-op.
"""

from __future__ import annotations

import contextlib
import math
import types

import pytest
import torch


class _TorchOnCpu(types.ModuleType):
    """``torch`` for megatron's schedules module, with ``zeros(device="cuda")`` on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


class _Patches(pytest.MonkeyPatch):
    """A MonkeyPatch that also exits context managers (config patches) on `undo`."""

    def __init__(self) -> None:
        super().__init__()
        self._contexts: list = []

    def enter(self, context) -> None:
        context.__enter__()
        self._contexts.append(context)

    def undo(self) -> None:
        while self._contexts:
            self._contexts.pop().__exit__(None, None, None)
        super().undo()


def apply_cpu_patches(pipeline: bool = False) -> pytest.MonkeyPatch:
    """Apply the patches (see the module doc; 5 only with ``pipeline``); ``.undo()`` on the
    result takes them back."""
    from megatron.core import utils as mutils
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    mp = _Patches()

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(math.prod(tensor_shape), dtype=dtype).view(*tensor_shape)

    @contextlib.contextmanager
    def fork(self, name=None):
        yield

    mp.setattr(mutils.GlobalMemoryBuffer, "get_tensor", get_tensor)
    mp.setattr(mrandom.CudaRNGStatesTracker, "fork", fork)
    mp.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    mp.setattr(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    mp.setattr(torch.cuda, "current_device", lambda: "cpu")
    # megatron-core 0.19 compiles small router helpers; with CUDA present (the GPU machine)
    # dynamo asks torch.cuda.current_device(), which is patched to "cpu" above, and fails.
    # The CPU world runs them eagerly.
    # Through dynamo's own config.patch: a monkeypatch of the config module's attribute is not
    # undone cleanly (after undo, reading `disable` raises and torch.compile breaks for later tests).
    import torch._dynamo as dynamo

    mp.enter(dynamo.config.patch(disable=True))
    mp.setattr(schedules, "torch", _TorchOnCpu("torch"))
    if not hasattr(moe_utils, "te_general_gemm"):
        mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
    if pipeline:
        mp.setattr(torch.cuda, "synchronize", lambda device=None: None)

    return mp


def example_worker_main(argv: list[str], pipeline: bool = False) -> int:
    """``examples/megatron_gpt.py``'s ``main(argv)`` with the CPU patches applied."""
    import importlib.util
    from pathlib import Path

    apply_cpu_patches(pipeline=pipeline)
    path = Path(__file__).resolve().parents[2] / "examples" / "megatron_gpt.py"
    spec = importlib.util.spec_from_file_location("megatron_gpt", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(argv)


def example_worker(rank: int, world: int, port: int, argv: list[str], log: str) -> None:
    """One rank of ``examples/megatron_gpt.py`` on the CPU (target of ``run_example``), its
    output to ``log`` formatted with its rank."""
    import os
    import sys

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    with open(log.format(rank=rank), "w") as f:  # the fork server's own output is no test's
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    # One thread a rank: the ranks share the machine's cores, and with several threads MKL's
    # dynamic threading may give a GEMM fewer of them when the machine is busy, which changes
    # its summation order (CI saw a reference run's first loss differ in its last bits).
    torch.set_num_threads(1)
    sys.exit(example_worker_main(argv, pipeline=True))


# The ranks are forks of a server that has imported torch, megatron-core and the library once
# for the test session (each run's ranks would otherwise spend about 5 s importing them). The
# server starts as a fresh interpreter, so the ranks inherit none of the test process's state
# (its gloo group, its patches).
_FORKSERVER_PRELOAD = ["torch", "megatron.core", "megatron.core.models.gpt", "megatron.core.pipeline_parallel",
                       "megatron.core.transformer.moe.moe_layer", "offload", "offload.integrations.megatron",
                       "offload.integrations.megatron_plan", "offload.tools.peak_live", "megatron_cpu"]


def run_example(out_dir, name: str, world: int, argv: list[str]) -> tuple[dict, str]:
    """``examples/megatron_gpt.py ARGV --json OUT_DIR/NAME.json`` on ``world`` CPU ranks (gloo):
    the run's JSON and rank 0's output. A rank that fails fails the test with every rank's output."""
    import json
    import multiprocessing
    from pathlib import Path

    import torch.multiprocessing as tmp
    from torch.multiprocessing.spawn import ProcessException

    from offload.testing import free_port

    multiprocessing.get_context("forkserver").set_forkserver_preload(_FORKSERVER_PRELOAD)
    out, log = out_dir / f"{name}.json", str(out_dir / f"{name}.rank{{rank}}.log")
    try:
        tmp.start_processes(example_worker, args=(world, free_port(), [*argv, "--json", str(out)], log),
                            nprocs=world, join=True, start_method="forkserver")
    except ProcessException as exc:
        logs = [Path(log.format(rank=r)) for r in range(world)]
        outputs = "\n".join(f"--- rank {r}:\n{p.read_text() if p.exists() else '(no output)'}"
                            for r, p in enumerate(logs))
        raise AssertionError(f"{exc}\n{outputs}") from None
    with open(log.format(rank=0)) as f:
        return json.loads(out.read_text()), f.read()


if __name__ == "__main__":
    # ``python tests/integrations/megatron_cpu.py ARGS``: examples/megatron_gpt.py ARGS on the
    # CPU, in one process (benchmarks/megatron_headtohead.py's tests launch it this way).
    import sys

    sys.exit(example_worker_main(sys.argv[1:]))
