"""gen.stream_video / generate_video on causal checkpoints, end to end on tiny ones: the frames equal an
independent reference of the published loop (each chunk's steps recomputed over the whole prefix under the
block-causal mask, no cache; the latents decoded at once), chunk by chunk as they come; a prompt switch changes the
chunks after it only; an endless stream stops when closed; every misuse refused before any compute."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument, UserError
from fastwan.vae.decode import decode_frames
from tests.stream.test_causal_dit import Masked

PROMPT = "a lighthouse at dusk, waves"


@pytest.fixture(scope="module")
def gen(tiny_causal):
    return VideoGenerator.from_pretrained(str(tiny_causal.fastvideo), device="cpu", dtype=torch.float32)


def block_causal(chunk_tokens: int, chunks: int) -> torch.Tensor:
    chunk = torch.arange(chunks).repeat_interleave(chunk_tokens)
    return chunk[None, :] <= chunk[:, None]


def reference_latents(gen, prompt_at, chunks: int, seed: int, height: int, width: int) -> torch.Tensor:
    """The published loop without a cache: chunk c's every forward runs the clean chunks 0..c-1 (at context_noise)
    and the current input together under the block-causal mask; ``prompt_at(c)`` is chunk c's prompt."""
    from fastwan.pipelines.text import encode_prompts

    model, recipe = gen.transformers[0], gen.causal
    f = recipe.frames_per_chunk
    _, spatial = gen.vae_scale_factors
    h, w = height // spatial, width // spatial
    tokens = f * (h // 2) * (w // 2)
    g = torch.Generator().manual_seed(seed)
    clean, plain = [], model.attention
    steps = recipe.schedule()
    for c in range(chunks):
        text = encode_prompts([prompt_at(c)], gen.tokenizer, gen.text_encoder, device=gen.device, dtype=gen.dtype)
        x = torch.randn(1, model.config.in_channels, f, h, w, generator=g)
        model.set_attention(Masked(plain, block_causal(tokens, c + 1)))
        try:
            for i, t in enumerate(steps):
                latents = torch.cat([*clean, x], 2)
                per_token = torch.tensor([recipe.context_noise] * (c * tokens) + [t] * tokens)[None]
                flow = model(latents, per_token, text)[:, :, c * f:]
                x0 = x - recipe.sigma(t) * flow
                if i + 1 < len(steps):
                    s = recipe.sigma(steps[i + 1])
                    x = (1 - s) * x0 + s * torch.randn(x.shape, generator=g)
        finally:
            model.set_attention(plain)
        clean.append(x0)
    return torch.cat(clean, 2)


def recorded(stream) -> list:
    """The latent chunks ``stream`` hands its decoder, in order."""
    seen, push = [], stream._decoder.push

    def record(latents):
        seen.append(latents.clone())
        return push(latents)

    stream._decoder.push = record
    return seen


def test_streamed_chunks_equal_the_published_loop_without_a_cache(gen):
    stream = gen.stream_video(PROMPT, num_frames=21, seed=7)
    seen = recorded(stream)
    chunks = list(stream)
    assert [c.index for c in chunks] == [0, 1] and [len(c.frames) for c in chunks] == [9, 12]
    assert [c.first_frame for c in chunks] == [0, 9]
    assert all(set(c.timings) == {"text", "dit", "kv_write", "decode", "elapsed"} for c in chunks)
    assert chunks[0].timings["text"] > 0 and chunks[1].timings["text"] == 0  # one encoding per prompt
    latents = reference_latents(gen, lambda c: PROMPT, 2, 7, 128, 128)
    torch.testing.assert_close(torch.cat(seen, 2), latents, rtol=1e-4, atol=1e-4)
    expected = decode_frames(gen.vae, latents, bars=False)
    got = np.concatenate([c.frames for c in chunks])
    assert got.shape == expected.shape == (21, 128, 128, 3)
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1


def test_generate_video_on_a_causal_checkpoint_is_the_stream_joined(gen, tmp_path):
    streamed = np.concatenate([c.frames for c in gen.stream_video(PROMPT, num_frames=21, seed=3)])
    steps = []
    res = gen.generate_video(PROMPT, num_frames=21, seed=3, output_path=str(tmp_path / "v.mp4"))
    assert np.array_equal(res.frames, streamed) and (tmp_path / "v.mp4").is_file()
    assert res.num_transformer_forwards == 2 * 5 - 1  # per chunk: 4 steps and the cache write; the last has none
    from fastwan.pipelines.params import GenerationRequest

    gen.generate(GenerationRequest(PROMPT, num_frames=21, seed=3, save_video=False),
                 on_step=lambda done, total: steps.append((done, total)))
    assert steps == [(1, 2), (2, 2)]  # one report per chunk


def test_a_prompt_switch_changes_only_the_chunks_after_it(gen):
    other = "a red car in the snow"
    plain = [c.frames for c in gen.stream_video(PROMPT, num_frames=33, seed=11)]
    stream = gen.stream_video(PROMPT, num_frames=33, seed=11)
    switched = []
    for chunk in stream:
        switched.append(chunk)
        if chunk.index == 0:
            stream.switch_prompt(other)
    assert [c.prompt for c in switched] == [PROMPT, other, other]
    assert np.array_equal(switched[0].frames, plain[0])
    assert not np.array_equal(switched[1].frames, plain[1]) and not np.array_equal(switched[2].frames, plain[2])
    latents = reference_latents(gen, lambda c: PROMPT if c == 0 else other, 3, 11, 128, 128)
    expected = decode_frames(gen.vae, latents, bars=False)
    assert np.abs(np.concatenate([c.frames for c in switched]).astype(int) - expected.astype(int)).max() <= 1


def test_an_endless_stream_runs_until_closed_and_frees_the_generator(gen):
    with gen.stream_video(PROMPT, seed=1, window_frames=6) as stream:
        for chunk in stream:
            if chunk.index == 4:
                break
    assert chunk.first_frame == 9 + 3 * 12
    assert gen.generate_video(PROMPT, num_frames=9, seed=1, save_video=False).frames.shape[0] == 9  # not locked


def test_misuse_is_refused_before_any_compute(gen, tiny_ckpts):
    with pytest.raises(InvalidArgument, match=r"num_frames=20: .* use 9 or 21"):
        gen.stream_video(PROMPT, num_frames=20)
    with pytest.raises(InvalidArgument, match="guidance_scale=5.0 does not apply to a causal checkpoint"):
        gen.generate_video(PROMPT, guidance_scale=5.0)
    with pytest.raises(InvalidArgument, match="num_inference_steps=8 does not apply"):
        gen.generate_video(PROMPT, num_inference_steps=8)
    with pytest.raises(InvalidArgument, match="height=100 is not a multiple of 16 .*; use 96 or 112"):
        gen.stream_video(PROMPT, height=100)
    with pytest.raises(InvalidArgument, match="window_frames=4 must be"):
        gen.stream_video(PROMPT, window_frames=4)
    with pytest.raises(InvalidArgument, match="prompt=''"):
        gen.stream_video("")
    plain = VideoGenerator.from_pretrained(str(tiny_ckpts["wan2.1"]), device="cpu", dtype=torch.float32)
    with pytest.raises(InvalidArgument, match="is not a causal checkpoint"):
        plain.stream_video(PROMPT)


@pytest.mark.parametrize("field, value", [("height", 100), ("width", 40.0), ("height", 0), ("seed", -1),
                                          ("seed", True), ("fps", 0), ("fps", 10**6)])
def test_a_stream_refuses_a_field_by_the_requests_own_rule(gen, field, value):
    from fastwan.pipelines.params import GenerationRequest

    with pytest.raises(UserError) as request:
        gen.resolve(GenerationRequest(PROMPT, save_video=False, **{field: value}))
    with pytest.raises(type(request.value)) as stream:
        gen.stream_video(PROMPT, **{field: value})
    assert str(stream.value) == str(request.value)


def test_a_compiled_generator_streams_the_eager_frames(gen, tiny_causal):
    torch._dynamo.reset()
    compiled = VideoGenerator.from_pretrained(str(tiny_causal.fastvideo), device="cpu", dtype=torch.float32,
                                              enable_torch_compile=True,
                                              torch_compile_kwargs={"backend": "aot_eager"})
    got = np.concatenate([c.frames for c in compiled.stream_video(PROMPT, num_frames=33, seed=2)])
    want = np.concatenate([c.frames for c in gen.stream_video(PROMPT, num_frames=33, seed=2)])
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    with pytest.raises(InvalidArgument, match="fullgraph=True cannot be used with a causal checkpoint"):
        VideoGenerator.from_pretrained(str(tiny_causal.fastvideo), device="cpu", enable_torch_compile=True,
                                       torch_compile_kwargs={"fullgraph": True})


def test_a_request_resolved_for_the_plain_base_does_not_run_on_a_causal_generator_over_it(tiny_causal):
    from fastwan.pipelines.params import GenerationRequest

    plain = VideoGenerator.from_pretrained(str(tiny_causal.base), device="cpu", dtype=torch.float32)
    causal = VideoGenerator.from_pretrained(str(tiny_causal.base), device="cpu", dtype=torch.float32,
                                            causal_weights=str(tiny_causal.flat))
    resolved = plain.resolve(GenerationRequest(PROMPT, num_frames=21, guidance_scale=5.0, save_video=False))
    with pytest.raises(InvalidArgument, match="resolved for .* as not causal .* this generator is causal"):
        causal.generate(resolved)
    back = causal.resolve(GenerationRequest(PROMPT, num_frames=21, save_video=False))
    with pytest.raises(InvalidArgument, match="as causal .* this generator is not causal"):
        plain.generate(back)


def test_a_stream_longer_than_the_trained_context_rolls_a_window_of_it(gen):
    def frames(n, **kw):
        with gen.stream_video(PROMPT, seed=4, **kw) as stream:
            return [c.frames for _, c in zip(range(n), stream)]

    assert gen.causal.context_frames == 21 and gen.causal.window_frames is None  # 7 chunks of 3
    endless = frames(8)
    assert all(np.array_equal(a, b) for a, b in zip(endless, frames(8, window_frames=21)))
    unbounded = frames(8, window_frames=None)
    assert all(np.array_equal(a, b) for a, b in zip(endless[:7], unbounded[:7]))  # the same within the context
    assert not np.array_equal(endless[7], unbounded[7])  # chunk 8 reaches past 21 frames: the window drops one
    short = np.concatenate([c.frames for c in gen.stream_video(PROMPT, seed=4, num_frames=81)])  # 21 latent frames
    assert np.array_equal(short, np.concatenate(unbounded[:7]))  # within the context: no window
