"""Test harness.

Without a CUDA device, Triton kernels run on CPU tensors through the interpreter: TRITON_INTERPRET
must be set before triton is first imported, which is why it happens here, at collection time.
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_report_header(config):
    where = "CUDA: " + torch.cuda.get_device_name() if HAS_CUDA else "CPU (Triton interpreter)"
    return f"surgery tests on {where}; torch {torch.__version__}"


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
