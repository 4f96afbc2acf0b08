"""Fixtures for the model-level tests (shared with tests/surgery).

These tests check the surgery (what is swapped, what reaches which kernel, that the patched model
trains like the original); the kernels' numerics are tested in tests/kernels. Through the Triton
interpreter a tiny model's step takes about a second, so by default the kernels take their
PyTorch path here; a test that asks for the ``interpreted`` fixture runs them through Triton (the
interpreter on CPU), so that every architecture is also exercised end to end on the real kernels.
"""

import pytest
import torch


@pytest.fixture
def interpreted():
    """Run the kernels through Triton (the interpreter on CPU, as tests/conftest.py sets up)."""


@pytest.fixture(autouse=True)
def _kernel_path(request, monkeypatch):
    if "interpreted" not in request.fixturenames:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    # Tiny matrices run fastest on one thread: with several, OpenMP workers spin against each other
    # and against whatever else shares the machine (a 50x slowdown seen on a loaded 2-core box).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
