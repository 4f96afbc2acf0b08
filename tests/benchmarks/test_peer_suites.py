"""``benchmarks/peer_suites``: the adapter that runs Liger's own tests over our kernels keeps
Liger's contract (checked here against PyTorch, without Liger), refuses what our kernels do not
have as a skip, replaces Liger's functions wherever Liger's modules hold them, and the summary
reads JUnit outcomes side by side."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "peer_suites"))

import liger_adapter
import summary


def _reference(x, w, bias, target, ignore_index, reduction, z_scale, smoothing):
    logits = F.linear(x, w, bias).float()
    valid = target != ignore_index
    ce = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=smoothing)  # fmt: skip
    z = torch.where(valid, z_scale * torch.logsumexp(logits, -1) ** 2, 0.0)
    z = {"mean": z.sum() / valid.sum(), "sum": z.sum(), "none": z}[reduction]
    first = logits.argmax(-1)
    hit = (valid & (first == target)).float()
    accuracy = hit if reduction == "none" else hit.sum() / valid.sum()
    return ce + z, z, accuracy, torch.where(valid, first, -1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_fused_head_keeps_ligers_contract(reduction, ignore_index):
    """loss (z-loss included), z_loss reduced as the loss, token accuracy (a fraction, per token
    under "none") and predicted tokens (-1 without a target), and the gradients, fp32."""
    torch.manual_seed(0)
    n, d, v = 24, 16, 40
    x = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    bias = torch.randn(v, requires_grad=True)
    target = torch.randint(0, v, (n,))
    target[::5] = ignore_index
    ours = liger_adapter.fused_linear_cross_entropy(
        x, w, target, bias, None, ignore_index, 1e-3, 0.1, reduction, None, True, None, False,
        True, True,
    )  # fmt: skip
    ref = _reference(x, w, bias, target, ignore_index, reduction, 1e-3, 0.1)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-6)
    upstream = torch.rand_like(ref[0]) + 0.5
    grads = torch.autograd.grad(ours[0], (x, w, bias), upstream)
    expected = torch.autograd.grad(ref[0], (x, w, bias), upstream)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_keeps_ligers_contract(reduction):
    """The same outputs over given logits, fp32: the logits' dtype is the loss's."""
    torch.manual_seed(0)
    logits = torch.randn(12, 30, requires_grad=True)
    target = torch.randint(0, 30, (12,))
    target[:3] = -100
    target[3:6] = logits[3:6].argmax(-1)  # some targets are the top-1
    ours = liger_adapter.cross_entropy(logits, target, None, -100, 1e-3, 0.1, reduction, None,
                                       True, True, True)  # fmt: skip
    ref = _reference(logits, torch.eye(30), None, target, -100, reduction, 1e-3, 0.1)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-6)
    assert ours[2].sum() > 0


@pytest.mark.parametrize(
    "call, reason",
    [
        (lambda x, w, t: liger_adapter.fused_linear_cross_entropy(x, w, t, None, torch.ones(8)),
         "class weights"),
        (lambda x, w, t: liger_adapter.fused_linear_cross_entropy(
            x, w, t, use_token_scaling=True), "token scaling"),
        (lambda x, w, t: liger_adapter.cross_entropy(x @ w.t(), t, torch.ones(8)),
         "class weights"),
    ],
)  # fmt: skip
def test_what_our_kernels_lack_is_a_skip_with_its_reason(call, reason):
    x, w, t = torch.randn(4, 3), torch.randn(8, 3), torch.randint(0, 8, (4,))
    with pytest.raises(pytest.skip.Exception, match=reason):
        call(x, w, t)


def test_install_replaces_every_module_holding_ligers_functions(monkeypatch):
    """Every liger_kernel module whose global is Liger's function gets ours; a module holding
    something else keeps it; other packages are left alone."""
    originals = {name: type(name, (), {}) for name in liger_adapter.REPLACED}
    flce, other = originals["LigerFusedLinearCrossEntropyFunction"], object()
    backend = "liger_kernel.ops.backends._triton.fused_linear_cross_entropy"
    names = [*liger_adapter.LIGER_MODULES, "liger_kernel", "liger_kernel.transformers", backend,
             "not_liger"]  # fmt: skip
    modules = {}
    for name in names:
        module = types.ModuleType(name)
        for function, original in originals.items():
            setattr(module, function, original)
        modules[name] = module
    modules["liger_kernel.transformers.cross_entropy"].LigerCrossEntropyFunction = other
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    places = liger_adapter.install()
    held = modules[backend]
    assert held.LigerFusedLinearCrossEntropyFunction is liger_adapter.SurgeryFusedLinearCrossEntropy
    functional = modules["liger_kernel.transformers.functional"]
    assert functional.LigerCrossEntropyFunction is liger_adapter.SurgeryCrossEntropy
    assert modules["liger_kernel.transformers.cross_entropy"].LigerCrossEntropyFunction is other
    assert modules["not_liger"].LigerFusedLinearCrossEntropyFunction is flce
    assert "liger_kernel.transformers.functional.LigerFusedLinearCrossEntropyFunction" in places
    swiglu = modules["liger_kernel.transformers.swiglu"]
    assert swiglu.LigerSiLUMulFunction is liger_adapter.SurgerySiLUMul


def _mentions_in_docstring_only():
    """Once element_mul_kernel scaled every row by the first row's gradient."""
    return 1


def _calls_in_a_nested_function():
    def inner():
        return element_mul_kernel  # noqa: F821 (never run: only its code is read)

    return inner


def _calls_through_a_module_helper():
    return _calls_in_a_nested_function()


def test_tests_calling_ligers_kernels_are_found_by_the_names_their_code_uses():
    """By the names the code uses (not its docstring), in nested functions and, given the test
    module's namespace, in the module's own helpers it calls."""
    used = liger_adapter._names_used
    assert "element_mul_kernel" not in used(_mentions_in_docstring_only.__code__, globals())
    assert "element_mul_kernel" in used(_calls_in_a_nested_function.__code__, globals())
    assert "element_mul_kernel" in used(_calls_through_a_module_helper.__code__, globals())
    assert "element_mul_kernel" not in used(_calls_through_a_module_helper.__code__)


JUNIT = """<testsuites><testsuite>{}</testsuite></testsuites>"""


def test_summary_sets_our_failures_beside_the_controls(tmp_path):
    control = tmp_path / "control.xml"
    ours = tmp_path / "ours.xml"
    control.write_text(JUNIT.format(
        '<testcase classname="t" name="a"/>'
        '<testcase classname="t" name="b"><failure message="ref off"/></testcase>'
        '<testcase classname="t" name="c"/>'
        '<testcase classname="u" name="d"/>'
    ))  # fmt: skip
    ours.write_text(JUNIT.format(
        '<testcase classname="t" name="a"><failure message="mismatch&#10;more"/></testcase>'
        '<testcase classname="t" name="b"><failure message="ref off"/></testcase>'
        '<testcase classname="t" name="c"><skipped message="no class weights"/></testcase>'
    ))  # fmt: skip
    result = summary.compare(summary.outcomes(str(control)), summary.outcomes(str(ours)))
    assert result["control"] == {"passed": 3, "failed": 1}
    assert result["missing"] == ["u::d"]
    assert result["surgery"] == {"failed": 2, "skipped": 1}
    assert result["skip_reasons"] == {"no class weights": 1}
    assert result["failures"] == [
        {"test": "t::a", "message": "mismatch", "control": "passed"},
        {"test": "t::b", "message": "ref off", "control": "failed"},
    ]


def test_cross_entropy_returns_the_logits_dtype_as_liger_does():
    logits = torch.randn(6, 10, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 10, (6,))
    loss, z, _, _ = liger_adapter.cross_entropy(logits, target, None, -100, 1e-4, 0.0, "mean",
                                                None, True)  # fmt: skip
    assert loss.dtype == z.dtype == torch.bfloat16
    ref = (
        F.cross_entropy(logits.float(), target)
        + 1e-4 * torch.logsumexp(logits.float(), -1).square().mean()
    )
    torch.testing.assert_close(loss.float(), ref, rtol=2**-8, atol=0)  # one bf16 rounding
    loss.backward(torch.ones_like(loss))  # a bf16 upstream gradient, as Liger's tests pass it
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("head", [True, False])
def test_a_label_out_of_range_raises_ligers_assertion(head):
    x, w = torch.randn(4, 3), torch.randn(8, 3)
    target = torch.tensor([1, 9, -100, 2])
    with pytest.raises(AssertionError, match="out of bounds"):
        if head:
            liger_adapter.fused_linear_cross_entropy(x, w, target)
        else:
            liger_adapter.cross_entropy(x @ w.t(), target)


@pytest.mark.parametrize("casting", ["llama", "gemma"])
@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_keeps_ligers_contract(casting, affine):
    """Liger's casting modes as transformers' modules compute them (``llama``: the normalised row
    rounded before the weight; ``gemma``: ``1 + weight`` in fp32, rounded once); without a weight
    the scale is 1."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, 32, dtype=torch.bfloat16)
    offset = 1.0 if casting == "gemma" else 0.0
    w = torch.randn(32, dtype=torch.bfloat16) if affine else None
    got = liger_adapter.rms_norm(x, w, 1e-6, offset, casting)
    normed = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)
    if not affine:
        want = normed.to(x.dtype)
    elif casting == "llama":
        want = w * normed.to(x.dtype)
    else:
        want = (normed * (offset + w.float())).to(x.dtype)
    # Within one bf16 step: the kernel's sum of squares may end in another fp32 bit than torch's.
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)


def test_silu_mul_and_rope_keep_ligers_contract():
    """SiLU-mul is silu(a) * b; RoPE takes cos/sin of 2, 3 or 4 dimensions as Liger reads them."""
    torch.manual_seed(0)
    a, b = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    torch.testing.assert_close(liger_adapter.silu_mul(a, b), F.silu(a) * b)
    q, k = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8)
    angles = torch.rand(7, 4) * 3
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rotated(t):
        half = torch.cat([-t[..., 4:], t[..., :4]], -1)
        return t * cos + half * sin

    for c, s in ((cos, sin), (cos[None], sin[None]), (cos[None, None], sin[None, None])):
        got_q, got_k = liger_adapter.rope(q, k, c, s)
        torch.testing.assert_close(got_q, rotated(q))
        torch.testing.assert_close(got_k, rotated(k))


@pytest.mark.parametrize(
    "call, reason",
    [
        (lambda: liger_adapter.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, 0.0, "none"),
         "casting mode 'none'"),
        (lambda: liger_adapter.silu_mul(torch.randn(2, 8), torch.randn(2, 8), 2.0), "multipliers"),
        (lambda: liger_adapter.rope(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8),
                                    torch.randn(3, 4), torch.randn(3, 4), rotary_dim=8),
         "rotary width"),
    ],
)  # fmt: skip
def test_what_our_layer_kernels_lack_is_a_skip_with_its_reason(call, reason):
    with pytest.raises(pytest.skip.Exception, match=reason):
        call()
