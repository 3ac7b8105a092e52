"""Prompt encoding (fastwan.pipelines.text.encode_prompts) against diffusers' WanPipeline.encode_prompt on the tiny
checkpoint's tokenizer and UMT5, at the edges of the text: truncation past 512 tokens, exactly 512, unicode, HTML
entities, whitespace. fastwan encodes the prompt and the negative prompt in one batch; diffusers one at a time."""
from __future__ import annotations

import pytest
import torch

from fastwan.pipelines.text import MAX_SEQUENCE_LENGTH, clean_prompt, encode_prompts

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
