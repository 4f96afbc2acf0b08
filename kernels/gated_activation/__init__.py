"""The gated MLP's activation, act(gate) * up (SwiGLU, GeGLU), fused forward and backward.

Elementwise, in fp32 whatever the storage dtype, rounded once:

    out   = act(g) * u
    dg    = dout * u * act'(g)          du = dout * act(g)

    silu:      act(g) = g s,   s = sigmoid(g)           act'(g) = s (1 + g (1 - s))
    gelu_tanh: act(g) = g s,   s = sigmoid(2 t),  t = sqrt(2/pi) (g + 0.044715 g^3)
               act'(g) = s + 2 g s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 g^2)

gelu_tanh is torch's ``gelu(approximate="tanh")`` (transformers' ``gelu_pytorch_tanh``), written
with 0.5 (1 + tanh(t)) = sigmoid(2 t): the same function, without tanh's cancellation for large
negative g. The forward saves g and u only; the backward recomputes act(g). Against transformers'
eager ``act_fn(gate) * up`` in bf16 (two roundings, and act(g) saved for backward) the result is
rounded once and one (…, I) tensor fewer is kept for backward.

``gated_activation_merged`` is the same map on one merged (…, 2 I) tensor holding gate then up
(a merged gate/up projection: transformers' experts keep ``gate_up_proj`` so). It reads both
halves in place and writes both gradients into one (…, 2 I) tensor: no copy of the halves is made
or kept, where ``gated_activation`` on two views of it would copy each.

Modules, in reading order: ``kernel`` (Triton kernels, split and merged layouts) ->
``launch`` (host launchers ``gated_activation_fwd``, ``gated_activation_bwd``,
``gated_activation_merged_fwd``, ``gated_activation_merged_bwd``, the launch configuration and the
PyTorch path) -> ``ops`` (torch.library ops and autograd) -> ``api`` (``gated_activation``,
``gated_activation_merged``) -> ``linear`` (``gated_linear``: the product and the down
projection after it as one step, the product rebuilt inside the activation's backward kernel),
with the fp32 reference ``gated_activation_reference`` in ``reference``.
"""

from __future__ import annotations

from .api import gated_activation, gated_activation_merged
from .kernel import (
    gated_activation_bwd_kernel,
    gated_activation_fwd_kernel,
    gated_activation_merged_bwd_kernel,
    gated_activation_merged_fwd_kernel,
)
from .launch import (
    ACTIVATIONS,
    DEFAULT_LAUNCH,
    FALLBACK_ELEMS,
    INTERPRETER_LAUNCH,
    GatedActivationLaunch,
    gated_activation_bwd,
    gated_activation_fwd,
    gated_activation_merged_bwd,
    gated_activation_merged_fwd,
)
from .launch import _merged_bwd_torch as _merged_bwd_torch  # names tests/surgery/test_experts.py
from .launch import _merged_fwd_torch as _merged_fwd_torch  # looks up (setattr needs them here)
from .linear import gated_linear, gated_linear_fuses
from .reference import gated_activation_reference

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_LAUNCH",
    "FALLBACK_ELEMS",
    "INTERPRETER_LAUNCH",
    "GatedActivationLaunch",
    "gated_activation",
    "gated_activation_bwd",
    "gated_activation_bwd_kernel",
    "gated_activation_fwd",
    "gated_activation_fwd_kernel",
    "gated_activation_merged",
    "gated_activation_merged_bwd",
    "gated_activation_merged_bwd_kernel",
    "gated_activation_merged_fwd",
    "gated_activation_merged_fwd_kernel",
    "gated_activation_reference",
    "gated_linear",
    "gated_linear_fuses",
]
