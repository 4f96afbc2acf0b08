"""Shared fixtures of the convergence tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: a second intra-op thread only spins against the Triton interpreter."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
