"""What a fastwan generation decoded: the final normalised latents, captured at ``VideoGenerator._decode``."""
from __future__ import annotations

import torch


def generate_with_latents(gen, prompt: str, **kw):
    """gen.generate_video(prompt, **kw) -> (result, the latents its VAE decode received, a copy)."""
    seen = []
    decode = gen._decode

    def keep(latents: torch.Tensor):
        seen.append(latents.detach().clone())
        return decode(latents)

    gen._decode = keep
    try:
        return gen.generate_video(prompt, **kw), seen[0]
    finally:
        del gen._decode
