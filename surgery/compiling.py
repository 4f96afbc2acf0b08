"""Host reads of batch data (is the padding only on the right? where do the packed documents
start?) under ``torch.compile``.

Eager, the causal-LM forward reads two facts about the batch on the host before running the model:
whether the attention mask can be dropped (``causal_right_padding``) and the packed documents'
boundaries (``varlen_attention``). A traced graph cannot branch on tensor data. So under
``torch.compile`` each read is taken one of two ways:

- graph breaks allowed (``fullgraph=False``, the default of ``model.compile()``,
  ``torch.compile(model)`` and the Trainer's ``torch_compile``): the read runs eagerly as one
  deliberate graph break before any tensor operation of the forward (no graph is compiled before
  it), and the rest of the forward is compiled with its answer, guarded on it: at most one graph
  per answer, each compiled once;
- ``fullgraph=True`` or ``torch._dynamo.error_on_graph_break(True)``: no break is possible; the
  padded batch keeps its mask (exact, a masked attention kernel) and the document boundaries come
  from an op at run time with a data-dependent size, which dynamo captures only in full-graph mode.

``graph_break_allowed`` asks the tracer which case applies, when it is called during tracing; it
reads dynamo's translator state (not a public API: on a torch without it, the answer is False and
the full-graph way is taken, which is exact either way).
"""

from __future__ import annotations

import torch

__all__ = ["graph_break_allowed", "host_read"]


@torch._dynamo.assume_constant_result
def graph_break_allowed() -> bool:
    """Under ``torch.compile``: whether the frame being traced may break its graph (neither
    ``fullgraph=True`` nor ``error_on_graph_break``). Dynamo calls it while tracing and keeps the
    answer as a constant of the graph (a frame's mode never changes). Call it only where
    ``torch.compiler.is_compiling()`` (eagerly, the translator it reads is a stale one)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return not (tx.one_graph or bool(getattr(tx, "error_on_graph_break", False)))
    except (ImportError, AttributeError):
        return False


def host_read(fn):
    """``fn`` run eagerly even inside a compiled forward (``torch.compiler.disable``): a graph break
    where it is called. Call it only where ``graph_break_allowed()``."""
    return torch.compiler.disable(fn, recursive=True)
