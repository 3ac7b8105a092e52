"""The denoising loop of :class:`fastwan.pipelines.generator.VideoGenerator`.

Per step: the expert of the step's timestep (Wan2.2 A14B: high noise while t >= boundary), the model input
(noise latents, plus the condition latents of image-to-video, or the image as frame 0 at timestep 0 for TI2V),
the prediction (CFG as one batch of 2 or two passes sharing their start, gated late in sampling, each pass under
its own step cache), then the sampler's update (:mod:`fastwan.pipelines.sampling`). The request's step caches are
hooks on the DiTs (:mod:`fastwan.models.wan.step_cache`) for the loop's duration.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from fastwan.cache import CacheRun
from fastwan.models.wan.step_cache import apply_step_cache, remove_step_cache
from fastwan.pipelines.sampling import Schedule
from fastwan.pipelines.step_parallel import chords_denoise


def denoise(gen, emb: torch.Tensor, s, seed: int, do_cfg: bool, image_inputs=None,
            run: CacheRun | None = None, on_step: Callable[[int, int], None] | None = None,
            start: tuple[torch.Tensor, int] | None = None,
            chords: tuple[int, ...] | None = None,
            generator: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    """``gen``: the VideoGenerator; emb [1 or 2, L, D] (cond[, uncond]); ``s``: the resolved settings;
    image_inputs: (condition latents, CLIP tokens or None) of an image-to-video call; run: the request's step
    caches; on_step: called as ``on_step(done, total)`` on the host after each step (an exception it raises ends
    the loop and propagates); start: video-to-video's (clean latents [1, C, F, H, W], steps run): only the
    schedule's last steps run, from the clean latents noised to the first one's level -> final latents
    [1, C, F, H, W] fp32, and the forward count; chords: CHORDS's start steps
    (:func:`fastwan.pipelines.step_parallel.chords_denoise`; the request's rules refused what it cannot run with);
    generator: the noise's random stream on the device (None: a new one seeded with ``seed``; Animate passes one
    stream through its segments)."""
    if chords is not None:
        return chords_denoise(gen, emb, s, seed, do_cfg, chords, on_step)
    hooks = []
    try:
        for e, t in enumerate(gen.transformers if run is not None else ()):
            hooks.append(apply_step_cache(t, run, e))
        return _denoise(gen, emb, s, seed, do_cfg, image_inputs, hooks, on_step, start, generator)
    finally:
        for t, _ in zip(gen.transformers, hooks):
            remove_step_cache(t)


def _denoise(gen, emb: torch.Tensor, s, seed: int, do_cfg: bool, image_inputs, hooks: list, on_step=None,
             start=None, generator=None):
    """:func:`denoise`'s loop; ``hooks``: the step cache on each expert's DiT (empty: none)."""
    from tqdm.auto import tqdm

    dev = gen.device
    ckpt = gen.checkpoint
    cfg = ckpt.transformer_config
    vt, vs = gen.vae_scale_factors
    condition, image_tokens = image_inputs if image_inputs is not None else (None, None)
    channels = cfg.out_channels if condition is not None else cfg.in_channels  # I2V reads noise + condition
    first_frame = condition is not None and ckpt.expand_timesteps  # TI2V: the image is frame 0
    shape = (1, channels, (s.num_frames - 1) // vt + 1, s.height // vs, s.width // vs)
    if generator is None:
        generator = torch.Generator(device=dev).manual_seed(int(seed))
    latents = torch.randn(shape, generator=generator, device=dev, dtype=torch.float32)
    if first_frame:  # 1 where the noise is denoised; the first latent frame is the image's, at timestep 0
        keep = torch.ones(1, 1, *shape[2:], device=dev)
        keep[:, :, 0] = 0
        token_keep = keep[0, 0][:, ::cfg.patch_size[1], ::cfg.patch_size[2]].flatten()[None]

    schedule = Schedule(s, gen.scheduler, dev, generator)  # fresh state per video
    if start is not None:  # video-to-video: the last steps, from the video's latents at the first one's noise
        clean, steps = start
        latents = schedule.start_from(clean, latents, len(schedule.timesteps) - steps)
    timesteps = schedule.timesteps
    n = len(timesteps)
    boundary = None
    if ckpt.boundary_ratio is not None:
        boundary = ckpt.boundary_ratio * gen.scheduler.config.num_train_timesteps
    gs2 = s.guidance_scale_2 if s.guidance_scale_2 is not None else s.guidance_scale
    gate_at = n if gen.cfg_gate_step is None else int(n * gen.cfg_gate_step)
    pt, ph, pw = cfg.patch_size
    tokens = (shape[2] // pt) * (shape[3] // ph) * (shape[4] // pw)

    cond, uncond = emb[:1], emb[1:2]
    par = gen.parallel  # with CFG parallelism each CFG group of ranks runs one pass (fastwan.parallel.mesh)
    split_cfg = par is not None and par.cfg_size == 2
    batched = gen._cfg_batched(tokens)
    delta = None  # last (cond - uncond), for CFG gating
    current = None
    forwards = 0

    def select(expert: int, name: str) -> None:  # a step cache decides per pass: the next forward's state
        if hooks:
            hooks[expert].select(name)

    # which expert runs each step, decided on the host once (no device sync inside the loop); compared as diffusers
    # does, tensor against Python float in the timesteps' precision (float32 for integer timesteps): a boundary
    # within that rounding above a timestep counts as reached
    experts = [0] * n if boundary is None else [0 if high else 1 for high in (timesteps >= boundary).tolist()]
    for i, t in enumerate(tqdm(timesteps, desc="denoising", leave=False, disable=not gen.progress_bars)):
        expert = experts[i]
        if expert != current:
            current, delta = expert, None  # a new expert: its own guidance delta
        if gen.placement is not None:
            gen.placement.expert(expert)  # with experts swapped: only this one on the GPU
        model = gen.transformers[expert]
        gs = s.guidance_scale if expert == 0 else gs2
        if first_frame:
            x = (1 - keep) * condition + keep * latents
        else:
            x = latents if condition is None else torch.cat([latents, condition], dim=1)
        x = x.to(model.dtype)
        timestep = token_keep * t.to(torch.float32) if first_frame else _timestep(ckpt, t, tokens)
        kw = {"step_index": i, "num_steps": n}
        if image_tokens is not None:
            kw["image"] = image_tokens
        step_cfg = do_cfg and gs != 1.0  # scale 1: the conditional prediction alone
        if step_cfg and (i < gate_at or delta is None):
            if split_cfg:  # one pass per CFG group of ranks, the two predictions exchanged
                select(expert, "uncond" if par.cfg_index else "cond")
                mine = model(x, timestep, uncond if par.cfg_index else cond, **kw)
                pos, neg = par.cfg_pair(mine)
            else:
                # cond and uncond share the latents: their common start (to block 0's cross-attention) once; under
                # a step cache each pass decides with its own state, one after the other
                pos, neg = model.forward_cfg(x, timestep, cond, uncond, batched=batched and not hooks, **kw)
            forwards += 2
            delta = pos - neg
            pred = neg + gs * delta
        elif step_cfg:  # gated: reuse the last guidance direction, no uncond forward
            select(expert, "cond")
            pos = model(x, timestep, cond, **kw)
            if split_cfg:  # every rank runs it; CFG group 0's counts (its step cache has the conditional history)
                pos = par.cfg_pair(pos)[0]
            forwards += 1
            pred = pos + (gs - 1.0) * delta
        else:
            select(expert, "cond")
            pred = model(x, timestep, cond, **kw)
            forwards += 1
        latents = schedule.step(pred, i, latents)
        if on_step is not None:
            on_step(i + 1, n)
    if first_frame:
        latents = (1 - keep) * condition + keep * latents
    return latents, forwards


def cache_report(run: CacheRun, par) -> dict:
    """The request's step-cache report (:meth:`CacheRun.report`); with CFG parallelism (``par``: the generator's
    Mesh) each pass as the CFG group that ran it decided, the same on every rank."""
    report = run.report()
    return par.cfg_report(report) if par is not None and par.cfg_size == 2 else report


def _timestep(ckpt, t: torch.Tensor, tokens: int) -> torch.Tensor:
    """The timestep of one sample: [1], or per token [1, S] for checkpoints with expand_timesteps (TI2V)."""
    if ckpt.expand_timesteps:
        return t.to(torch.float32).expand(1, tokens)  # a view: no host round trip
    return t.expand(1)
