"""Shared fixtures: every test gets a fresh engine, and leaves none behind."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

# Deterministic cuBLAS must be chosen before CUDA starts (bitwise comparisons on the GPU).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import offload  # noqa: E402
from offload.manager import PipelineOffloadManager  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _fresh_engine():
    yield
    if PipelineOffloadManager._instance is not None:
        PipelineOffloadManager._instance.reset(release_pool=True)
        PipelineOffloadManager._instance = None


@pytest.fixture
def configure():
    """``configure(modules, **kw)``: a fresh engine on the CPU fallback unless ``device`` says
    otherwise (also on a GPU machine, where the CPU tests' tensors are CPU tensors); the
    CPU-fallback warning is silenced."""

    def make(modules, **kw):
        kw.setdefault("min_tensor_bytes", 0)
        kw.setdefault("device", "cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return offload.configure(modules, **kw)

    return make


def requires_cuda(fn):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn))
