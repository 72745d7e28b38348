"""A tiny megatron-core world on the CPU: gloo, world size 1, model parallel sizes 1.

The patches that megatron-core needs on a CPU are in ``megatron_cpu.py`` (shared with the
spawned workers of the pipeline test).
"""

from __future__ import annotations

import pytest
import torch

from megatron_cpu import apply_cpu_patches, free_port  # megatron is imported when used


@pytest.fixture(scope="module")
def megatron_cpu():
    """Patch megatron-core for the CPU and start gloo with world size 1."""
    from megatron.core import parallel_state

    mp = apply_cpu_patches()
    started = not torch.distributed.is_initialized()
    if started:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if started:
        torch.distributed.destroy_process_group()
    mp.undo()
