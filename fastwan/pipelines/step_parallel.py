"""Step-parallel sampling of one request: CHORDS (:mod:`fastwan.parallel.chords`). In one process each round is one
batched DiT call over the cores' latents (with CFG a batch of 2 x cores: the conditional passes, then the
unconditional ones); a generator of several processes runs each core on its own ranks
(:mod:`fastwan.parallel.chords_ranks`: N = cores x S processes, S a core with sequence parallelism), each call
one latent (a batch of 2 with CFG).

Rule: CHORDS runs a text-to-video request of one expert with fastwan's ``euler`` sampler, without a step cache,
video-to-video, an image, CFG gating or a sparse attention backend: each of those reads the step as one point of
one trajectory, which CHORDS's cores do not share; over processes, the layout's rule
(:func:`~fastwan.parallel.chords_ranks.check_layout`). They are refused before any compute.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from fastwan.errors import InvalidArgument
from fastwan.parallel.chords import check_chords, chords, rounds_needed
from fastwan.parallel.chords_ranks import check_layout, run_ranks
from fastwan.pipelines.sampling import Schedule


def check_chords_request(r, s, cache, image, video, experts: int) -> tuple[int, ...] | None:
    """The CHORDS start steps of request ``r`` (a GenerationRequest; None: sequential sampling) with settings ``s``,
    the step cache in force, its image and video requests and the checkpoint's expert count; raises on the
    combinations of the module's rule."""
    if r.parallel_sampling is None:
        return None
    init = check_chords(r.chords_cores, s.num_inference_steps, r.chords_init, sampler=s.sampler)
    why = ("a step cache (pass cache='none')" if cache is not None else
           "an image (image-to-video)" if image is not None else
           "video-to-video" if video is not None else
           "a checkpoint with two experts (Wan2.2 A14B: the cores' steps fall on both)" if experts > 1 else None)
    if why is not None:
        raise InvalidArgument(f"chords_cores={r.chords_cores} (CHORDS) cannot run with {why}: its cores sample "
                              "at different steps at once; drop one of the two.", field="chords_cores")
    return init


def check_chords_generator(gen, cores: int) -> None:
    """Rule: CHORDS (``cores`` cores) runs without CFG gating, on a dense attention backend, in one process or over
    processes as :func:`~fastwan.parallel.chords_ranks.check_layout` says."""
    why = ("cfg_gate_step" if gen.cfg_gate_step is not None else
           "a sparse attention backend" if gen.attention.sparse else None)
    if why is not None:
        raise InvalidArgument(f"chords_cores={cores} (CHORDS) cannot run with {why}: its cores sample at different "
                              "steps at once; use a dense generator without cfg_gate_step.")
    if gen.parallel is not None:
        check_layout(cores, gen.parallel.world, gen.parallel.cfg_size == 2)


def chords_denoise(gen, emb: torch.Tensor, s, seed: int, do_cfg: bool, init: tuple[int, ...],
                   on_step: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, int]:
    """:func:`fastwan.pipelines.denoise.denoise` for CHORDS with start steps ``init``: the same start latents (the
    seed's noise) and sampler grid -> final latents [1, C, F, H, W] fp32 and the forward count (the batched
    calls, one per round, two with CFG; over processes the same count: the rounds of the returned core);
    ``on_step(done, total)`` counts rounds. Over processes the latents are rank 0's (None elsewhere)."""
    dev = gen.device
    ckpt = gen.checkpoint
    cfg = ckpt.transformer_config
    vt, vs = gen.vae_scale_factors
    shape = (1, cfg.in_channels, (s.num_frames - 1) // vt + 1, s.height // vs, s.width // vs)
    generator = torch.Generator(device=dev).manual_seed(int(seed))
    latents = torch.randn(shape, generator=generator, device=dev, dtype=torch.float32)
    schedule = Schedule(s, gen.scheduler, dev, generator)
    if gen.placement is not None:
        gen.placement.expert(0)
    model = gen.transformers[0]
    pt, ph, pw = cfg.patch_size
    tokens = (shape[2] // pt) * (shape[3] // ph) * (shape[4] // pw)
    cond, uncond = emb[:1], emb[1:2]
    gs = s.guidance_scale
    step_cfg = do_cfg and gs != 1.0
    total = rounds_needed(init, len(schedule.timesteps))
    counts = {"forwards": 0, "rounds": 0}

    def velocity(xs: torch.Tensor, steps: tuple[int, ...]) -> torch.Tensor:
        x = xs.flatten(0, 1).to(model.dtype)  # [n, C, F, H, W]
        n = x.shape[0]
        t = schedule.timesteps[list(steps)]
        if ckpt.expand_timesteps:
            t = t.to(torch.float32)[:, None].expand(n, tokens)
        kw = {"step_index": min(steps), "num_steps": len(schedule.timesteps)}
        if step_cfg:
            out = model(torch.cat([x, x]), torch.cat([t, t]),
                        torch.cat([cond.expand(n, -1, -1), uncond.expand(n, -1, -1)]), **kw)
            pos, neg = out[:n], out[n:]
            pred = neg + gs * (pos - neg)
            counts["forwards"] += 2
        else:
            pred = model(x, t, cond.expand(n, -1, -1), **kw)
            counts["forwards"] += 1
        return pred.to(torch.float32).unsqueeze(1)

    if gen.parallel is not None:  # each core on its own ranks, one latent a call
        out = run_ranks(gen.parallel, gen.transformers, lambda x, step: velocity(x[None], (step,))[0], latents,
                        schedule.sigmas, init, cfg.num_attention_heads, on_step)
        return out, total * (2 if step_cfg else 1)

    def batched(xs: torch.Tensor, steps: tuple[int, ...]) -> torch.Tensor:
        out = velocity(xs, steps)
        counts["rounds"] += 1
        if on_step is not None:
            on_step(counts["rounds"], total)
        return out

    result = chords(batched, latents, schedule.sigmas, len(init), init)
    return result.latents, counts["forwards"]
