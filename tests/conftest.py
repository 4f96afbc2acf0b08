"""Test harness.

Without a CUDA device, Triton kernels run on CPU tensors through the interpreter: TRITON_INTERPRET
must be set before triton is first imported, which is why it happens here, at collection time.
"""

from __future__ import annotations

import os
import re

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# A skip reason that says the test needs a GPU: such a test must carry the ``gpu`` marker, or
# ``pytest -m gpu`` (how the GPU machine runs its tests) deselects it and it runs nowhere.
CUDA_SKIP = re.compile(r"\b(cuda|gpus?)\b", re.IGNORECASE)


def unmarked_cuda_skip(item: pytest.Item, reason: str) -> str | None:
    """An error message where ``item`` skips for want of a GPU (``reason``) without the ``gpu``
    marker; None otherwise."""
    if "gpu" in item.keywords or not CUDA_SKIP.search(reason):
        return None
    return (
        f"{item.nodeid} skips for want of a GPU ({reason!r}) but has no @pytest.mark.gpu: "
        "`pytest -m gpu` on the GPU machine would deselect it, so it would run nowhere"
    )


def pytest_collection_modifyitems(config, items):
    unmarked = [
        message
        for item in items
        for mark in item.iter_markers("skipif")
        if any(bool(condition) for condition in mark.args)
        and (message := unmarked_cuda_skip(item, str(mark.kwargs.get("reason", ""))))
    ]
    if unmarked:
        raise pytest.UsageError("\n".join(unmarked))
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip raised while the test runs (``pytest.skip``) for want of a GPU, without the ``gpu``
    marker, fails: the same rule as the collection check above, for skips a marker cannot show."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and call.excinfo is not None and call.when != "teardown":
        message = unmarked_cuda_skip(item, str(call.excinfo.value))
        if message is not None:
            report.outcome, report.longrepr = "failed", message


def pytest_report_header(config):
    where = "CUDA: " + torch.cuda.get_device_name() if HAS_CUDA else "CPU (Triton interpreter)"
    return f"surgery tests on {where}; torch {torch.__version__}"


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _kept_logits_slots():
    """A failed test's graph (held by its traceback) keeps the fused head's kept-logits slot
    taken: every later forward in the process would recompute. Each test starts with it free."""
    import sys

    ops = sys.modules.get("surgery.kernels.linear_cross_entropy.ops")
    if ops is not None:
        ops._KEPT.clear()


@pytest.fixture(autouse=True)
def _margins(request, monkeypatch):
    """With ``SURGERY_MARGINS=DIR``: record how close each budget check comes (tests.margins)."""
    from tests import margins

    if not margins.recording():
        yield
        return
    margins.install(request.node.nodeid, monkeypatch)
    yield
    margins.uninstall()
