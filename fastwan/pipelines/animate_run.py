"""Wan2.2-Animate's segment loop: ``generate``'s compute for an Animate request (diffusers' ``WanAnimatePipeline``).

Once per video: the prompts' text embeddings, the character image's CLIP tokens (of the image as given) and its
conditioning latents (:func:`~fastwan.pipelines.animate.reference_latents`), the driving videos padded to the
segments' end (:func:`~fastwan.pipelines.animate.pad_indices`) and made pixels. Per segment of the plan
(:class:`~fastwan.pipelines.animate.SegmentPlan`):

* fresh noise [1, z, T + 1, h, w] (T: the segment's latent frames, plus the reference's), drawn from one seeded
  generator that runs on over the segments;
* the pose latents of the segment's pose frames, the face frames, and the conditioning latents: the reference's
  latent frame, then the segment's (:func:`~fastwan.pipelines.animate.segment_latents`: the last ``overlap``
  frames made before, then zeros or the background);
* the schedule from its start (the scheduler's state fresh per segment), the DiT reading the pose and face
  (:func:`~fastwan.models.wan.animate.animate_inputs`; CFG's unconditional pass reads a face of every pixel -1);
* the latents after the reference's frame decoded to pixels in [-1, 1]; a segment after the first drops its
  first ``overlap`` frames (they repeat the previous segment's last ones).

The segments' frames joined are cut to the driving videos' length.
"""
from __future__ import annotations

import time

import torch

from fastwan.checkpoint.presets import runs_cfg
from fastwan.errors import InvalidArgument
from fastwan.models.wan.animate import animate_inputs
from fastwan.pipelines.animate import (AnimateRequest, driving_pixels, mask_pixels, pad_indices, reference_latents,
                                       reference_pixels, segment_latents)
from fastwan.pipelines.denoise import denoise
from fastwan.pipelines.image import clip_tokens, normalized_latents
from fastwan.pipelines.setup import sync
from fastwan.pipelines.text import encode_prompts
from fastwan.vae.decode import decode_pixels, uint8_frames


def check_animate_generator(gen) -> None:
    """Rule: an Animate video runs on one device with the Wan VAE (each segment is conditioned on the frames the
    last one decoded)."""
    if gen.parallel is not None:
        raise InvalidArgument("Wan2.2-Animate runs on one GPU: its face adapters attend per latent frame, which "
                              "sequence parallelism splits; load the generator with num_gpus=1.")
    if gen.tiny_vae is not None:
        raise InvalidArgument("vae='tiny' cannot make a Wan2.2-Animate video: each segment is conditioned on the "
                              "last frames of the one before, which the Wan VAE decodes and encodes; load the "
                              "generator without vae='tiny'.")


def _driving(a: AnimateRequest, height: int, width: int, face_size: int) -> dict[str, torch.Tensor]:
    """The driving videos padded to the plan's end, as pixels: pose and background [1, 3, N, H, W] in [-1, 1], face
    [1, 3, N, size, size], mask [1, 1, N, H, W] in [0, 1]."""
    order = pad_indices(a.plan.frames, a.plan.target_frames)
    frames = {name: [video[i] for i in order] for name, video in a.videos.items()}
    out = {"pose_video": driving_pixels(frames["pose_video"], height, width),
           "face_video": driving_pixels(frames["face_video"], face_size, face_size)}
    if a.mode == "replace":
        out["background_video"] = driving_pixels(frames["background_video"], height, width)
        out["mask_video"] = mask_pixels(frames["mask_video"], height, width)
    return out


def animate_frames(gen, prompt: str, negative_prompt: str, s, seed: int, a: AnimateRequest, on_step=None):
    """``generate``'s compute for an Animate request ``a`` (the caller holds the generator's lock; ``s``: the
    settings, ``s.num_frames`` what the DiT denoises: the segment's frames after the character image's) ->
    (frames uint8 [T, H, W, 3], DiT forwards, timings, peak CUDA bytes or None, None). ``on_step(done, total)``
    after each step, counted over all segments."""
    check_animate_generator(gen)
    dev, dit, plan = gen.device, gen.transformers[0], a.plan
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    size = (s.height, s.width)
    t0 = time.perf_counter()
    do_cfg = runs_cfg(s)
    with gen._phase("encoding"):
        emb = encode_prompts([prompt, negative_prompt] if do_cfg else [prompt], gen.tokenizer, gen.text_encoder,
                             device=dev, dtype=gen.dtype)
        tokens = clip_tokens(gen.image_encoder, gen.image_processor, [a.image]).to(dev, gen.dtype)
        reference = reference_latents(gen.vae, reference_pixels(a.image, *size))
        videos = _driving(a, *size, dit.config.motion_encoder_size)
    sync(dev)
    t1 = time.perf_counter()
    generator = torch.Generator(device=dev).manual_seed(int(seed))  # one stream over the segments
    total = len(plan.starts) * s.num_inference_steps
    parts, previous, forwards, decoding = [], None, 0, 0.0
    for k, start in enumerate(plan.starts):
        span = slice(start, start + plan.segment_frames)
        with gen._phase("denoising"):
            pose = normalized_latents(gen.vae, videos["pose_video"][:, :, span])
            background, mask = (None, None) if a.mode != "replace" else (
                videos["background_video"][:, :, span], videos["mask_video"][:, :, span])
            condition = torch.cat([reference, segment_latents(gen.vae, plan, start, size, previous, background, mask)],
                                  dim=2)
            face = videos["face_video"][:, :, span].to(dev, dit.dtype)
            done = k * s.num_inference_steps
            step = None if on_step is None else (lambda i, n, done=done: on_step(done + i, total))
            with animate_inputs(dit, pose.to(dit.dtype), face, face_uncond=face * 0 - 1,
                                motion_batch_size=a.motion_batch_size):
                latents, n = denoise(gen, emb, s, seed, do_cfg, (condition, tokens), on_step=step,
                                     generator=generator)
        forwards += n
        sync(dev)
        d0 = time.perf_counter()
        pixels = decode_pixels(gen.vae, latents[:, :, 1:], gen.vae_chunk_frames, gen.progress_bars)
        previous = pixels[:, :, -plan.overlap:]
        parts.append(pixels if k == 0 else pixels[:, :, plan.overlap:])
        sync(dev)
        decoding += time.perf_counter() - d0
    frames = uint8_frames(torch.cat(parts, dim=2)[:, :, :plan.frames])
    t2 = time.perf_counter()
    timings = {"text_encoding": t1 - t0, "denoising": t2 - t1 - decoding, "decoding": decoding, "total": t2 - t0}
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return frames, forwards, timings, peak, None
