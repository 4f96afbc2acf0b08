"""The mini configs of the Llama family (``surgery.models.llama``), by ``model_type``."""

from ..mini import MINI_VISION_TOWER, MiniConfig, MiniMultimodalConfig, from_size

MINI_CONFIGS: dict[str, MiniConfig] = {
    "llama": MiniConfig(
        "LlamaConfig",
        # Llama 3's RoPE base, not transformers' default: frequencies must come from the model.
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}},
    ),
    "llama4_text": MiniConfig(
        "Llama4TextConfig",
        {
            # RoPE (chunked) and no-RoPE (global) layers in turn, the no-RoPE ones MoE, the RoPE
            # ones dense: every kind of layer in two. Chunks shorter than the sequences, and a
            # temperature that grows within them (the real models': floor_scale 8192, attn_scale
            # 0.1, chunks of 8192).
            "no_rope_layer_interval": 2,
            "attention_chunk_size": from_size("sliding_window"),
            "floor_scale": 2,
            "attn_scale": 0.5,
            "interleave_moe_layer_step": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size": from_size("head_dim"),  # the experts' and the shared expert's
            "intermediate_size_mlp": from_size("intermediate_size"),  # the dense layers'
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
}

MINI_MULTIMODAL_CONFIGS: dict[str, MiniMultimodalConfig] = {
    # 16 x 16 images in 4 x 4 patches, pixel-shuffled by half: four tokens each.
    "llama4": MiniMultimodalConfig(
        "Llama4Config",
        "Llama4VisionConfig",
        {
            **MINI_VISION_TOWER,
            "intermediate_size": 64,  # the pixel shuffle's output: 16 / 0.5**2
            "image_size": 16,
            "patch_size": 4,
            "vision_output_dim": 32,
            "projector_input_dim": 32,
            "projector_output_dim": 32,
        },
        special_tokens=("image_token_index", "boi_token_index", "eoi_token_index"),
    ),
}
