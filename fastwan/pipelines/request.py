"""A video request checked against what a checkpoint's files say (its preset, the DiT's config, the VAE's factors,
the scheduler), with no weight loaded: ``generate_video`` runs it before any compute, and the CLI before it loads
the model, so a mistyped argument fails in seconds rather than after minutes of loading."""
from __future__ import annotations

from fastwan.checkpoint.safetensors import read_json
from fastwan.checkpoint.presets import with_overrides
from fastwan.checkpoint.resolver import Checkpoint
from fastwan.pipelines.image import ImageRequest, check_frames, check_image_request, default_size
from fastwan.pipelines.inputs import check_inputs, expert_guidance
from fastwan.pipelines.sampling import check_sampling, check_training_grid, fresh_scheduler, sampler_shift
from fastwan.vae.decode import scale_factors


def checkpoint_vae_factors(ckpt: Checkpoint) -> tuple[int, int]:
    """(temporal, spatial) latent compression of the checkpoint's VAE, from its config.json."""
    return scale_factors(read_json(ckpt.folder("vae") / "config.json", missing="the vae component needs it."))


def check_request(ckpt: Checkpoint, preset, scheduler, vae_factors: tuple[int, int], prompt, *, image=None,
                  last_image=None, negative_prompt=None, height=None, width=None, num_frames=None,
                  num_inference_steps=None, guidance_scale=None, guidance_scale_2=None, seed=None, fps=None,
                  sampler=None, timesteps=None, flow_shift=None) -> tuple[object, ImageRequest | None, tuple]:
    """``generate_video``'s arguments checked for ``ckpt`` (``preset`` filling each None; ``scheduler``: the
    checkpoint's diffusers scheduler, not stepped) -> (the resolved settings, the image request or None, the DiT's
    token grid). Raises the user errors of :mod:`fastwan.pipelines.inputs`, ``image`` and ``sampling``."""
    req = check_image_request(ckpt, image, last_image)
    if req is not None and (height is None or width is None):  # the missing side(s) from the image's aspect
        cfg = ckpt.transformer_config
        multiple = vae_factors[1] * cfg.patch_size[1]
        height, width = default_size(req.first, preset.height * preset.width, multiple, height, width,
                                     max_side=cfg.rope_max_seq_len * multiple)
    guidance_scale, guidance_scale_2 = expert_guidance(preset, guidance_scale, guidance_scale_2)
    s = check_sampling(with_overrides(preset, height=height, width=width, num_frames=num_frames,
                                      guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2, fps=fps),
                       sampler, timesteps, flow_shift, num_inference_steps)
    cfg = ckpt.transformer_config
    stepper = None  # fastwan's own samplers checked their timesteps already
    if s.sampler == "default":
        stepper = fresh_scheduler(scheduler, s.flow_shift)
    else:
        check_training_grid(s, scheduler)
        sampler_shift(s, scheduler)
    grid = check_inputs(prompt, negative_prompt, s, seed, vae_factors=vae_factors, patch=cfg.patch_size,
                        scheduler=stepper, max_grid=cfg.rope_max_seq_len, experts=len(ckpt.experts))
    check_frames(req, s.num_frames)
    return s, req, grid
