"""Attention and packing: the attention forward and its masks (``forward``, ``eager``,
``shared_mask``), chunked, vision, latent and linear attention (``chunked``, ``vision``, ``mla``,
``linear``), packed documents through variable-length flash attention (``varlen``) and a padded
batch's real tokens alone (``unpadding``)."""
