"""LoRA files written for the tests, and bit-level comparisons of a generator's DiT weights."""
from __future__ import annotations

import torch

# (diffusers module, original Wan module) of every linear layer a block has
BLOCK_MODULES = [("attn1.to_q", "self_attn.q"), ("attn1.to_k", "self_attn.k"), ("attn1.to_v", "self_attn.v"),
                 ("attn1.to_out.0", "self_attn.o"), ("attn2.to_q", "cross_attn.q"), ("attn2.to_k", "cross_attn.k"),
                 ("attn2.to_v", "cross_attn.v"), ("attn2.to_out.0", "cross_attn.o"), ("ffn.net.0.proj", "ffn.0"),
                 ("ffn.net.2", "ffn.2")]
IMAGE_MODULES = [("attn2.add_k_proj", "cross_attn.k_img"), ("attn2.add_v_proj", "cross_attn.v_img")]  # CLIP I2V


def random_lora(model, fmt: str, rank: int = 4, seed: int = 0, alpha: float | None = None) -> dict:
    """A LoRA on every block linear of ``model`` (a diffusers or fastwan DiT with diffusers names) in ``fmt``:
    diffusers, wan (``diffusion_model.`` original names) or kohya (``lora_unet_`` underscored original names, an
    alpha per module as musubi-tuner writes, ``alpha`` x 1.0 ... 1.x so each module's own alpha counts)."""
    g = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    out = {}
    for i in range(len(model.blocks)):
        block = BLOCK_MODULES + [m for m in IMAGE_MODULES if f"blocks.{i}.{m[0]}" in mods]
        for j, (diff_name, wan_name) in enumerate(block):
            w = mods[f"blocks.{i}.{diff_name}"].weight
            a = torch.randn(rank, w.shape[1], generator=g) * 0.3
            b = torch.randn(w.shape[0], rank, generator=g) * 0.3
            if fmt == "diffusers":
                out[f"transformer.blocks.{i}.{diff_name}.lora_A.weight"] = a
                out[f"transformer.blocks.{i}.{diff_name}.lora_B.weight"] = b
            elif fmt == "kohya":
                key = f"lora_unet_blocks_{i}_{wan_name.replace('.', '_')}"
                out[f"{key}.lora_down.weight"], out[f"{key}.lora_up.weight"] = a, b
                out[f"{key}.alpha"] = torch.tensor(alpha * (1 + j / 10))
            else:
                key = f"diffusion_model.blocks.{i}.{wan_name}"
                out[f"{key}.lora_down.weight"], out[f"{key}.lora_up.weight"] = a, b
                if alpha is not None:
                    out[f"{key}.alpha"] = torch.tensor(alpha)
                if diff_name == "attn2.to_out.0":
                    out[f"{key}.diff_b"] = torch.randn(w.shape[0], generator=g) * 0.2
    return out


def bits(g) -> list[dict[str, torch.Tensor]]:
    """Every DiT tensor of ``g``, FP8 ones as their bytes."""
    return [{k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v).clone()
             for k, v in t.state_dict().items()} for t in g.transformers]


def changed(a, b) -> list[str]:
    return [k for x, y in zip(a, b) for k in x if not torch.equal(x[k], y[k])]
