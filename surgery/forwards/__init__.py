"""The generic forwards that replace transformers' own: the causal LM's (``causal_lm``), the base
model's (``base_model``), the lm_head's fused loss (``head``), norms and MLPs (``layers``), MoE
experts (``experts``), multimodal wrappers (``multimodal``), and the activations rebuilt in the
backward (``recompute``). Each reads what differs from the spec, never a model's name."""
