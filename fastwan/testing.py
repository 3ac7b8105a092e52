"""Tiny random Wan checkpoints in the Diffusers layout, written offline (tests, CI, the README's first command).

Three variants, the same component layout as the published checkpoints:

- ``wan2.1``: transformer + UMT5 text encoder + tokenizer + ``AutoencoderKLWan`` + UniPC scheduler;
- ``wan2.2-a14b``: two experts (``transformer``, ``transformer_2``) and ``boundary_ratio`` in model_index.json;
- ``wan2.2-ti2v``: 48-channel latents, the residual VAE (spatial factor 16) and ``expand_timesteps``.

Weights are random (seeded), saved as safetensors. The tokenizer is a small Unigram model built in code,
so nothing is downloaded.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

VARIANTS = ("wan2.1", "wan2.2-a14b", "wan2.2-ti2v")
TINY_IDS = {
    "tiny": "wan2.1",
    "tiny-wan2.1": "wan2.1",
    "tiny-wan2.2-a14b": "wan2.2-a14b",
    "tiny-wan2.2-ti2v": "wan2.2-ti2v",
}
_FORMAT = 1  # bump when the tiny layout changes, so cached copies are rebuilt

TEXT_DIM = 32


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-")
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(c, -3.0) for c in chars] + [("\u2581" + c, -2.5) for c in chars]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0)


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def write_tiny_checkpoint(path: str | Path, variant: str = "wan2.1", *, seed: int = 0) -> Path:
    """Write a tiny random checkpoint of ``variant`` (one of :data:`VARIANTS`) to ``path``; returns it."""
    if variant not in VARIANTS:
        raise ValueError(f"tiny variant {variant!r} is unknown; use one of {', '.join(VARIANTS)}.")
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ti2v = variant == "wan2.2-ti2v"
    channels = 48 if ti2v else 16

    tokenizer = _tokenizer()
    tokenizer.save_pretrained(path / "tokenizer")
    te_cfg = UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    )
    torch.manual_seed(seed)
    te = UMT5EncoderModel(te_cfg).eval()
    _randomize(te, seed + 1, std=0.5)
    te.save_pretrained(path / "text_encoder", safe_serialization=True)

    experts = ["transformer", "transformer_2"] if variant == "wan2.2-a14b" else ["transformer"]
    for i, name in enumerate(experts):
        dit = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=channels,
            out_channels=channels, text_dim=TEXT_DIM, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
        )
        _randomize(dit, seed + 10 + i, std=0.1)
        dit.save_pretrained(path / name, safe_serialization=True)

    if ti2v:
        vae = AutoencoderKLWan(
            base_dim=8, decoder_base_dim=8, z_dim=48, in_channels=12, out_channels=12, is_residual=True,
            patch_size=2, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
            scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
        )
    else:
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    torch.manual_seed(seed + 20)
    vae.save_pretrained(path / "vae", safe_serialization=True)

    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                    num_train_timesteps=1000)
    sched.save_pretrained(path / "scheduler")

    index = {
        "_class_name": "WanPipeline",
        "_diffusers_version": "0.35.0",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"] if len(experts) == 2 else [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "boundary_ratio": 0.875 if len(experts) == 2 else None,
        "expand_timesteps": ti2v,
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return path


def tiny_cache_dir() -> Path:
    root = os.environ.get("FASTWAN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "fastwan"
    )
    return Path(root) / "tiny"


def tiny_checkpoint(variant: str = "wan2.1") -> Path:
    """Path of a cached tiny checkpoint of ``variant``, written on first use (atomically)."""
    if variant not in VARIANTS:
        raise ValueError(f"tiny variant {variant!r} is unknown; use one of {', '.join(VARIANTS)}.")
    final = tiny_cache_dir() / f"{variant}-v{_FORMAT}"
    if (final / "model_index.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{variant}-", dir=final.parent))
    try:
        write_tiny_checkpoint(tmp, variant)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race
            if not (final / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
