"""The original Wan release's module names (``WanModel``: ``blocks.N.self_attn.q``, ``head.head``, ...) and the
DiT's, which are diffusers' (``blocks.N.attn1.to_q``, ``proj_out``, ...): :data:`ORIGINAL_NAMES` maps the first to
the second. LoRA files (:mod:`fastwan.lora.keys`) and whole DiT state dicts saved under the original names
(Self-Forcing's and CausVid's generators, :mod:`fastwan.checkpoint.causal_files`) read through it."""
from __future__ import annotations

import re

ORIGINAL_NAMES = (  # original Wan module (or parameter) name -> the DiT's (diffusers') name
    (r"blocks\.(\d+)\.self_attn\.([qkv])", r"blocks.\1.attn1.to_\2"),
    (r"blocks\.(\d+)\.self_attn\.o", r"blocks.\1.attn1.to_out.0"),
    (r"blocks\.(\d+)\.cross_attn\.([qkv])", r"blocks.\1.attn2.to_\2"),
    (r"blocks\.(\d+)\.cross_attn\.o", r"blocks.\1.attn2.to_out.0"),
    (r"blocks\.(\d+)\.cross_attn\.k_img", r"blocks.\1.attn2.add_k_proj"),
    (r"blocks\.(\d+)\.cross_attn\.v_img", r"blocks.\1.attn2.add_v_proj"),
    (r"blocks\.(\d+)\.ffn\.0", r"blocks.\1.ffn.net.0.proj"),
    (r"blocks\.(\d+)\.ffn\.2", r"blocks.\1.ffn.net.2"),
    (r"text_embedding\.0", "condition_embedder.text_embedder.linear_1"),
    (r"text_embedding\.2", "condition_embedder.text_embedder.linear_2"),
    (r"time_embedding\.0", "condition_embedder.time_embedder.linear_1"),
    (r"time_embedding\.2", "condition_embedder.time_embedder.linear_2"),
    (r"time_projection\.1", "condition_embedder.time_proj"),
    (r"head\.head", "proj_out"),
    (r"patch_embedding", "patch_embedding"),
    (r"img_emb\.proj\.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    (r"img_emb\.proj\.3", "condition_embedder.image_embedder.ff.net.2"),
    # norms (a LoRA's deltas of them are not merged, as in diffusers; named so that they read as norms, not unknown
    # keys). The block's affine norm before the cross-attention is the original's norm3 and diffusers' norm2 (the
    # original's norm2, before the FFN, holds no parameters)
    (r"blocks\.(\d+)\.self_attn\.norm_([qk])", r"blocks.\1.attn1.norm_\2"),
    (r"blocks\.(\d+)\.cross_attn\.norm_([qk])", r"blocks.\1.attn2.norm_\2"),
    (r"blocks\.(\d+)\.cross_attn\.norm_k_img", r"blocks.\1.attn2.norm_added_k"),
    (r"blocks\.(\d+)\.norm3", r"blocks.\1.norm2"),
    (r"head\.norm", "norm_out"),
    (r"img_emb\.proj\.0", "condition_embedder.image_embedder.norm1"),
    (r"img_emb\.proj\.4", "condition_embedder.image_embedder.norm2"),
    # parameters outside the layers (modulation tables, FLF2V's image position embedding): a LoRA's deltas of them
    # are not merged, as in diffusers
    (r"blocks\.(\d+)\.modulation", r"blocks.\1.scale_shift_table"),
    (r"head\.modulation", "scale_shift_table"),
    (r"img_emb\.emb_pos", "condition_embedder.image_embedder.pos_embed"),
)
_COMPILED = tuple((re.compile(pattern), repl) for pattern, repl in ORIGINAL_NAMES)


def dit_name(original: str) -> str | None:
    """An original Wan tensor name (``blocks.0.self_attn.q.weight``, ``head.modulation``) -> the DiT's
    (``blocks.0.attn1.to_q.weight``, ``scale_shift_table``), or None when it is no original Wan name. Rule: the whole
    name is a parameter of :data:`ORIGINAL_NAMES` (the modulation tables), or its part before the last dot is a
    module of it."""
    for pattern, repl in _COMPILED:
        m = pattern.fullmatch(original)
        if m:
            return m.expand(repl)
    module, dot, tensor = original.rpartition(".")
    if not dot:
        return None
    for pattern, repl in _COMPILED:
        m = pattern.fullmatch(module)
        if m:
            return f"{m.expand(repl)}.{tensor}"
    return None
