"""Prompt cleaning and UMT5 encoding, the way WanPipeline does it (same cleaning, padding and trimming)."""
from __future__ import annotations

import html
import re

import torch

MAX_SEQUENCE_LENGTH = 512


def clean_prompt(text: str) -> str:
    """ftfy repair, double HTML unescape, whitespace collapse."""
    import ftfy

    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip()


@torch.no_grad()
def encode_prompts(
    prompts: list[str],
    tokenizer,
    text_encoder,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_length: int = MAX_SEQUENCE_LENGTH,
) -> torch.Tensor:
    """prompts (N strings) -> embeddings [N, max_length, d_model] in ``dtype``.

    Each prompt is tokenized to ``max_length`` tokens; the encoder's outputs past the real tokens are
    replaced by zeros (what Wan was trained with).
    """
    batch = tokenizer(
        [clean_prompt(p) for p in prompts], padding="max_length", max_length=max_length, truncation=True,
        add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
    )
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    hidden = text_encoder(ids, mask).last_hidden_state.to(dtype=dtype)
    lengths = mask.gt(0).sum(dim=1)
    keep = torch.arange(max_length, device=device)[None, :] < lengths[:, None]
    return hidden * keep[..., None].to(hidden.dtype)
