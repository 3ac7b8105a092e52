"""The whole pipeline vs diffusers' WanPipeline on the same tiny checkpoint and seed (fp32), and its prompt encoding
(fastwan.pipelines.text.encode_prompts) against WanPipeline.encode_prompt on the tiny checkpoint's tokenizer and
UMT5, at the edges of the text: truncation past 512 tokens, exactly 512, unicode, HTML entities, whitespace.
fastwan encodes the prompt and the negative prompt in one batch; diffusers one at a time."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from fastwan import VideoGenerator
from fastwan.checkpoint.presets import WAN_NEGATIVE_PROMPT
from fastwan.pipelines.text import MAX_SEQUENCE_LENGTH, clean_prompt, encode_prompts
from tests.pipelines.latents import generate_with_latents

SIZE = dict(height=64, width=64, num_frames=9)


def reference_frames(path, prompt, negative_prompt, seed, latents=None, **kw):
    """diffusers' uint8 frames; with a dict ``latents``, its ["z"] gets the latents of the last step (decoded)."""
    pipe = WanPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def keep(pipe, i, t, tensors):
        if latents is not None:
            latents["z"] = tensors["latents"].detach().clone()
        return {}

    out = pipe(prompt, negative_prompt=negative_prompt, generator=torch.Generator("cpu").manual_seed(seed),
               output_type="np", callback_on_step_end=keep, **kw).frames[0]
    return (out * 255).round().astype(np.uint8)


CASES = [
    ("wan2.1", "blurry, low quality", dict(num_inference_steps=4, guidance_scale=5.0)),
    ("wan2.1", None, dict(num_inference_steps=3, guidance_scale=4.0)),
    ("wan2.2-a14b", "blurry", dict(num_inference_steps=6, guidance_scale=4.0, guidance_scale_2=3.0)),
    ("wan2.2-ti2v", "blurry", dict(num_inference_steps=4, guidance_scale=5.0)),
]


@pytest.mark.parametrize("variant,negative,kw", CASES)
def test_pipeline_matches_diffusers(tiny_ckpts, variant, negative, kw):
    path = tiny_ckpts[variant]
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    res, latents = generate_with_latents(gen, "a cat walks on the grass", negative_prompt=negative, seed=11,
                                         save_video=False, **SIZE, **kw)
    # fastwan applies Wan's default negative prompt when none is given; diffusers gets it explicitly
    seen = {}
    want = reference_frames(path, "a cat walks on the grass", negative or WAN_NEGATIVE_PROMPT, 11, seen, **SIZE, **kw)
    assert res.frames.dtype == np.uint8 and res.frames.shape == want.shape == (9, 64, 64, 3)
    assert want.std() > 5  # a real picture, not a constant
    assert np.abs(res.frames.astype(int) - want.astype(int)).max() <= 1
    torch.testing.assert_close(latents, seen["z"], rtol=0, atol=1e-5)  # frames hardly see the text here


def test_a14b_case_crosses_the_expert_boundary(tiny_ckpts):
    """The A14B parity case above really uses both experts (high-noise first, then low-noise)."""
    gen = VideoGenerator.from_pretrained(tiny_ckpts["wan2.2-a14b"], device="cpu", dtype=torch.float32)
    from tests.pipelines.test_cfg import record_batches

    rec = record_batches(gen)
    gen.generate_video("a dog", seed=0, save_video=False, num_inference_steps=6, **SIZE)
    calls = [e for e, _ in rec]
    assert calls[0] == 0 and calls[-1] == 1 and calls == sorted(calls)


def test_vae_tiling_matches_diffusers_tiled_decode(tiny_ckpts):
    """vae_tiling={...} decodes like diffusers' WanPipeline with vae.enable_tiling(same sizes), and differs from
    the untiled decode (the tiles really are blended)."""
    path = tiny_ckpts["wan2.1"]
    tiles = dict(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                 tile_sample_stride_width=16)
    kw = dict(num_inference_steps=3, guidance_scale=4.0)
    gen = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32, vae_tiling=tiles)
    assert gen.vae.use_tiling and gen.vae.tile_sample_min_height == 32
    res = gen.generate_video("a cat", negative_prompt="blurry", seed=3, save_video=False, **SIZE, **kw)
    pipe = WanPipeline.from_pretrained(path, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.enable_tiling(**tiles)
    want = pipe("a cat", negative_prompt="blurry", generator=torch.Generator("cpu").manual_seed(3), output_type="np",
                **SIZE, **kw).frames[0]
    want = (want * 255).round().astype(np.uint8)
    assert np.abs(res.frames.astype(int) - want.astype(int)).max() <= 1
    plain = VideoGenerator.from_pretrained(path, device="cpu", dtype=torch.float32)
    untiled = plain.generate_video("a cat", negative_prompt="blurry", seed=3, save_video=False, **SIZE, **kw)
    assert np.abs(res.frames.astype(int) - untiled.frames.astype(int)).max() > 1


# ---- prompt encoding ----------------------------------------------------------------------------------------------
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def text_parts(tiny_ckpts):
    from diffusers import WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel

    root = tiny_ckpts["wan2.1"]
    tok = AutoTokenizer.from_pretrained(root / "tokenizer")
    te = UMT5EncoderModel.from_pretrained(root / "text_encoder").eval()
    pipe = WanPipeline(tokenizer=tok, text_encoder=te, transformer=None, vae=None, scheduler=None)
    return tok, te, pipe


def diffusers_embeds(pipe, prompt, negative):
    with torch.no_grad():
        return pipe.encode_prompt(prompt, negative, do_classifier_free_guidance=True,
                                  max_sequence_length=MAX_SEQUENCE_LENGTH, device=CPU, dtype=torch.float32)


PROMPTS = {  # prompt -> its token count with </s> (the tiny tokenizer: one token per letter, "▁" starts a word)
    "a fox " * 200: 512,  # 800 tokens: truncated, </s> kept last
    "a " * 511: 512,  # exactly 512
    "a " * 510: 511,
    "  \t leading,\n\n trailing \u3000 ": 17,
    "猫が走る 🦊 ünïcödé": 13,  # unknown to the tiny vocabulary: <unk> tokens
    "tom &amp;amp; jerry &lt;3 &quot;x&quot;": 18,  # entities decoded twice, as diffusers does
}


@pytest.mark.parametrize("prompt", list(PROMPTS), ids=["truncated", "exactly-512", "511", "whitespace", "unicode",
                                                       "html"])
def test_embeddings_match_diffusers(text_parts, prompt):
    tok, te, pipe = text_parts
    negative = "blurry, low quality"
    want, want_neg = diffusers_embeds(pipe, prompt, negative)
    got = encode_prompts([prompt, negative], tok, te, device=CPU, dtype=torch.float32)
    assert got.shape == (2, MAX_SEQUENCE_LENGTH, want.shape[-1])
    torch.testing.assert_close(got[:1], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1:], want_neg, rtol=1e-5, atol=1e-6)
    # the rows past the prompt's tokens are exact zeros (Wan's padding), the others are not
    n = PROMPTS[prompt]
    assert int(got[0].abs().sum(-1).gt(0).sum()) == n
    ids = tok(clean_prompt(prompt), truncation=True, max_length=MAX_SEQUENCE_LENGTH).input_ids
    assert len(ids) == n and ids[-1] == tok.eos_token_id


def test_empty_negative_prompt_is_diffusers_none_and_empty(text_parts):
    """diffusers encodes negative_prompt None and "" alike (as ""); fastwan's encoding of "" is that embedding
    (generate_video's None is Wan's own negative prompt instead, by design: fastwan.checkpoint.presets)."""
    tok, te, pipe = text_parts
    _, none_neg = diffusers_embeds(pipe, "a fox", None)
    _, empty_neg = diffusers_embeds(pipe, "a fox", "")
    got = encode_prompts(["a fox", ""], tok, te, device=CPU, dtype=torch.float32)
    torch.testing.assert_close(none_neg, empty_neg, rtol=0, atol=0)
    torch.testing.assert_close(got[1:], empty_neg, rtol=1e-5, atol=1e-6)
    assert int(got[1].abs().sum(-1).gt(0).sum()) == 1  # "" is </s> alone
