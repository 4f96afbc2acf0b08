"""The test harness's own rules (tests/conftest.py), each seen failing on a planted break."""

from __future__ import annotations

import pytest

UNMARKED = """
import pytest
import torch

@pytest.mark.skipif(True, reason="needs a CUDA device (flash attention)")
def test_marked_skip():
    pass

def test_skip_in_the_body():
    pytest.skip("no CUDA GPU here")
"""

MARKED = """
import pytest

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_marked_skip():
    pass

@pytest.mark.gpu
def test_skip_in_the_body():
    pytest.skip("no CUDA GPU here")

@pytest.mark.skipif(True, reason="this transformers release has no helper")
def test_other_skip():
    pass
"""


@pytest.fixture
def harness(pytester):
    pytester.makeconftest(
        "from tests.conftest import pytest_collection_modifyitems, pytest_runtest_makereport\n"
    )
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    return pytester


def test_a_cuda_skip_without_the_gpu_marker_fails(harness):
    """A test that skips for want of a GPU but lacks ``@pytest.mark.gpu`` would run nowhere
    (``pytest -m gpu`` deselects it): the collection stops with its name."""
    harness.makepyfile(test_planted=UNMARKED)
    result = harness.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_marked_skip skips for want of a GPU*"])


def test_a_skip_raised_in_the_body_without_the_gpu_marker_fails(harness):
    harness.makepyfile(
        test_planted=UNMARKED.split("@pytest.mark.skipif")[0] + UNMARKED.split("    pass\n", 1)[1]
    )
    result = harness.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_skip_in_the_body skips for want of a GPU*"])


def test_marked_gpu_skips_and_other_skips_pass(harness):
    harness.makepyfile(test_planted=MARKED)
    result = harness.runpytest("-p", "no:cacheprovider")
    # The harness itself skips gpu tests without a GPU; on the GPU machine the skipif remains.
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(skipped=3)
