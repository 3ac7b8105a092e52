"""A :class:`~fastwan.pipelines.params.GenerationRequest` resolved for a checkpoint: the preset fills each unset
field, and the checkpoint's rules are checked (its DiT's config, the VAE's factors, the scheduler, the image it
needs, the step cache against the steps), with no weight loaded. A generator resolves each request before any
compute; the CLI resolves it from the checkpoint's files before the model loads and hands the result to the
generator, so a mistyped argument fails in seconds and no rule is checked twice."""
from __future__ import annotations

from dataclasses import dataclass

from fastwan.cache import CacheConfig, resolve_coefficients
from fastwan.checkpoint.presets import WAN_NEGATIVE_PROMPT, with_overrides
from fastwan.checkpoint.resolver import Checkpoint
from fastwan.checkpoint.safetensors import read_json
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.pipelines.animate import AnimateRequest, check_animate_request
from fastwan.pipelines.image import ImageRequest, check_frames, check_image_request, default_size
from fastwan.pipelines.inputs import check_inputs, expert_guidance
from fastwan.pipelines.params import GenerationRequest
from fastwan.pipelines.sampling import check_sampling, check_training_grid, fresh_scheduler, sampler_shift
from fastwan.pipelines.step_parallel import check_chords_request
from fastwan.pipelines.stream import check_causal_request
from fastwan.pipelines.vace import VaceRequest, check_vace_composes, check_vace_grid, check_vace_request
from fastwan.pipelines.video import VideoRequest, check_steps, check_video_request, steps_run
from fastwan.vae.decode import scale_factors


def checkpoint_vae_factors(ckpt: Checkpoint) -> tuple[int, int]:
    """(temporal, spatial) latent compression of the checkpoint's VAE, from its config.json."""
    return scale_factors(read_json(ckpt.folder("vae") / "config.json", missing="the vae component needs it."))


@dataclass(frozen=True)
class ResolvedRequest:
    """``request`` as ``checkpoint`` (its root) runs it: ``settings`` (a Preset: every size, step and sampling
    setting filled), ``image`` (the image request or None), ``grid`` (the DiT's token grid), ``cache`` (the step
    cache in force: the request's, else the generator's default), TeaCache's ``coefficients`` and ``video`` (the
    video-to-video input, or None)."""

    request: GenerationRequest
    checkpoint: str
    settings: object
    image: ImageRequest | None
    grid: tuple[int, int, int]
    cache: CacheConfig | None
    coefficients: tuple | None
    video: VideoRequest | None = None
    chords: tuple[int, ...] | None = None
    vace: VaceRequest | None = None  # a VACE checkpoint's control input (fastwan.pipelines.vace)
    causal: object = None  # the checkpoint's CausalRecipe (None: not causal): its rules were the ones checked
    # a Wan2.2-Animate request; settings.num_frames is then what the DiT denoises: a segment's frames and 4 more (the
    # character image's latent frame before them)
    animate: AnimateRequest | None = None

    @property
    def negative_prompt(self) -> str:
        return WAN_NEGATIVE_PROMPT if self.request.negative_prompt is None else self.request.negative_prompt

    def identity(self) -> dict:
        """What besides the settings makes the video (the automatic file name's identity): the input video's pixels
        and strength, CHORDS's cores, VACE's and Animate's inputs."""
        out = {} if self.video is None else {"video": self.video.digest, "strength": self.video.strength}
        if self.chords is not None:  # CHORDS's frames are its own
            out["chords"] = list(self.chords)
        if self.vace is not None:
            out["vace"] = self.vace.digest
        if self.animate is not None:
            out["animate"] = self.animate.digest
        return out

    def describe(self) -> str:
        """One line: the size, frames, steps, guidance and sampler the video will be made with."""
        s = self.settings
        guidance = f"{s.guidance_scale:g}" + ("" if s.guidance_scale_2 is None else f" / {s.guidance_scale_2:g}")
        sampler = "" if s.sampler == "default" else f", sampler {s.sampler}"
        cache = "" if self.cache is None else f", step cache {self.cache.name}"
        v = self.video
        video = "" if v is None else (f", from a video at strength {v.strength:g} (its last "
                                      f"{steps_run(s.num_inference_steps, v.strength)} steps)")
        chords = "" if self.chords is None else f", CHORDS on {len(self.chords)} cores from steps {list(self.chords)}"
        vace = "" if self.vace is None else f", VACE with {len(self.vace.references)} reference images"
        if self.animate is not None:
            return (f"{s.width}x{s.height} at {s.fps} fps, {self.animate.describe()}, {s.num_inference_steps} steps "
                    f"per segment, guidance {guidance}{sampler}")
        return (f"{s.width}x{s.height}, {s.num_frames} frames at {s.fps} fps, {s.num_inference_steps} steps, "
                f"guidance {guidance}{sampler}{cache}{video}{chords}{vace}")


def resolve_request(ckpt: Checkpoint, scheduler, vae_factors: tuple[int, int], request: GenerationRequest,
                    default_cache: CacheConfig | None = None) -> ResolvedRequest:
    """``request`` for ``ckpt`` (``scheduler``: the checkpoint's diffusers scheduler, not stepped; ``vae_factors``:
    its VAE's (temporal, spatial) factors; ``default_cache``: the generator's step cache, used when the request names
    none). Raises the user errors of :mod:`fastwan.pipelines.inputs`, ``image``, ``sampling`` and ``cache``."""
    if not isinstance(request, GenerationRequest):
        raise InvalidArgumentType(f"request={request!r} must be a fastwan.GenerationRequest.")
    r, preset, cfg = request, ckpt.preset, ckpt.transformer_config
    if ckpt.causal is not None:  # its recipe decides the steps; a whole number of chunks
        check_causal_request(r, ckpt.causal, vae_factors[0])
    animate = check_animate_request(ckpt, r)
    height, width = r.height, r.width
    vace = check_vace_request(ckpt, r, vae_factors[1] * cfg.patch_size[1])
    req = None if animate is not None else check_image_request(ckpt, r.image, r.last_image)
    video = None if vace is not None or animate is not None else check_video_request(ckpt, r.video, r.strength,
                                                                                      r.image, r.num_frames)
    num_frames = r.num_frames if video is None else len(video.frames)
    if animate is not None:  # the DiT denoises a segment at a time, after the character image's latent frame
        num_frames = animate.plan.segment_frames + vae_factors[0]
    if vace is not None and vace.video is not None:  # VACE makes a video of the control video's frames and size
        num_frames, (height, width) = vace.frames, vace.size
    if req is not None and (height is None or width is None):  # the missing side(s) from the image's aspect
        multiple = vae_factors[1] * cfg.patch_size[1]
        height, width = default_size(req.first, preset.height * preset.width, multiple, height, width,
                                     max_side=cfg.rope_max_seq_len * multiple)
    guidance_scale, guidance_scale_2 = expert_guidance(preset, r.guidance_scale, r.guidance_scale_2)
    s = check_sampling(with_overrides(preset, height=height, width=width, num_frames=num_frames,
                                      guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2, fps=r.fps),
                       r.sampler, r.timesteps, r.flow_shift, r.num_inference_steps)
    stepper = None  # fastwan's own samplers checked their timesteps already
    if s.sampler == "default":
        stepper = fresh_scheduler(scheduler, s.flow_shift)
    else:
        check_training_grid(s, scheduler)
        sampler_shift(s, scheduler)
    grid = check_inputs(s, vae_factors=vae_factors, patch=cfg.patch_size, scheduler=stepper,
                        max_grid=cfg.rope_max_seq_len, experts=len(ckpt.experts))
    check_frames(req, s.num_frames)
    cache = default_cache if r.cache is None else None if r.cache == "none" else r.cache
    if animate is not None and cache is not None:
        raise InvalidArgument(f"step cache {cache.name!r} with Wan2.2-Animate: its segments are not cached yet; pass "
                              "cache='none' (or load the generator without a default cache).", field="cache")
    if vace is not None:
        check_vace_grid(vace, grid, cfg.patch_size, cfg.rope_max_seq_len)
        check_vace_composes(vace, cache, r.parallel_sampling)
    # TeaCache's coefficients, and whether the cache can skip any of the request's steps
    if video is not None:
        check_steps(video, s.num_inference_steps, cache)
    coefficients = resolve_coefficients(cache, ckpt.variant, cfg.inner_dim, s.height, s.width, s.num_inference_steps)
    chords = check_chords_request(r, s, cache, req, video, len(ckpt.experts))
    return ResolvedRequest(r, str(ckpt.root), s, req, grid, cache, coefficients, video, chords, vace, ckpt.causal,
                           animate)


def check_resolved_for(resolved: ResolvedRequest, ckpt: Checkpoint) -> None:
    """Rule: a resolved request runs on the checkpoint it was resolved for."""
    if resolved.checkpoint != str(ckpt.root):
        raise InvalidArgument(f"this request was resolved for {resolved.checkpoint}, not {ckpt.root}; pass the "
                              "GenerationRequest itself (resolved_request.request) to this generator.")
    if resolved.causal != ckpt.causal:
        had, has = ("causal" if c is not None else "not causal" for c in (resolved.causal, ckpt.causal))
        raise InvalidArgument(f"this request was resolved for {resolved.checkpoint} as {had} ({resolved.causal}), "
                              f"but this generator is {has} ({ckpt.causal}); pass the GenerationRequest itself "
                              "(resolved_request.request) to this generator.")
