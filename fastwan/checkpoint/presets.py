"""Generation presets: the size, frames, steps, guidance and sampling a checkpoint gets for what the caller leaves
unset, by the kind of model (:func:`fastwan.checkpoint.resolver.resolve` picks them)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

DMD_SHIFT = 8.0  # FastVideo's DmdDenoisingStage: FlowMatchEulerDiscreteScheduler(shift=8.0), for every checkpoint


@dataclass(frozen=True)
class Preset:
    """Generation defaults a model gets when the caller passes ``None``."""

    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    guidance_scale_2: float | None
    fps: int
    sampler: str = "default"  # fastwan.pipelines.sampling.SAMPLERS
    timesteps: tuple[float, ...] | None = None  # the sampler's (euler / dmd); None: evenly spaced
    flow_shift: float | None = None  # None: the checkpoint scheduler's


# Image-to-video presets follow the Wan repos' generate.py: I2V 40 steps, FLF2V 50, guidance 5.0 (Wan2.1) and
# 3.5 / 3.5 (Wan2.2 A14B); height x width is the pixel area, the image's aspect ratio decides the sides.
# Wan2.1-I2V-14B-480P and -720P have identical configs: a checkpoint whose name (Hub id or folder path) says
# 720P gets the 720P area, any other the 480P one.
PRESETS = {
    "wan2.1": Preset(480, 832, 81, 50, 5.0, None, 16),
    "wan2.2-a14b": Preset(720, 1280, 81, 40, 4.0, 3.0, 16),
    "wan2.2-ti2v": Preset(704, 1280, 121, 50, 5.0, None, 24),
    "wan2.1-i2v": Preset(480, 832, 81, 40, 5.0, None, 16),
    "wan2.1-i2v-720p": Preset(720, 1280, 81, 40, 5.0, None, 16),
    "wan2.1-flf2v": Preset(720, 1280, 81, 50, 5.0, None, 16),
    "wan2.2-i2v-a14b": Preset(720, 1280, 81, 40, 3.5, 3.5, 16),
    "wan2.2-animate": Preset(720, 1280, 77, 20, 1.0, None, 30),
}
# Wan2.2-Animate (Wan2.2's animate_14B config, diffusers' WanAnimatePipeline defaults): 720 x 1280, 20 steps, no
# CFG, 30 fps; its video has the driving videos' frame count, made in segments: num_frames is the segment's length
# (77), not the video's.
# FastVideo's DMD-distilled checkpoints (model_index.json "_class_name": "WanDMDPipeline", FastWan; or its
# image-to-video "WanImageToVideoDmdPipeline") sample as FastVideo's DMD stage does: timesteps 1000, 757, 522 on
# its shift-8 grid (for every kind: the stage builds its own shift-8 scheduler, whatever the pipeline config's
# flow_shift, TI2V-5B's 5.0 included), no CFG; the Wan2.1 text-to-video ones at FastVideo's 61 x 448 x 832 preset
# (fast_wan_t2v_480p, for FastWan2.1-T2V-1.3B and -14B-480P), any other kind at its own preset's size (TI2V-5B:
# 121 x 704 x 1280 at 24 fps, as fast_wan_2_2_ti2v_5b).
DMD_SETTINGS = MappingProxyType(dict(num_inference_steps=3, guidance_scale=1.0, guidance_scale_2=None,
                                     sampler="dmd", timesteps=(1000.0, 757.0, 522.0), flow_shift=DMD_SHIFT))
DISTILLED_SIZES = MappingProxyType({"wan2.1": MappingProxyType(dict(height=448, width=832, num_frames=61))})
# VSA-trained checkpoints (the DiT carries to_gate_compress gates) run VSA by default, at FastVideo's sparsity for
# FastWan: 0.9 for the 14B width (5120), 0.8 below; 4 x 4 x 4-token cubes as trained
VSA_TILE = (4, 4, 4)


def trained_vsa_sparsity(inner_dim: int) -> float:
    return 0.9 if inner_dim >= 5120 else 0.8


# tiny checkpoints: the same kinds of models at sizes a 2-core CPU makes in seconds
TINY_PRESETS = {
    "wan2.1": Preset(128, 128, 17, 8, 5.0, None, 8),
    "wan2.2-a14b": Preset(128, 128, 17, 8, 4.0, 3.0, 8),
    "wan2.2-ti2v": Preset(128, 128, 17, 8, 5.0, None, 8),
    "wan2.1-i2v": Preset(64, 64, 9, 4, 5.0, None, 8),
    "wan2.1-flf2v": Preset(64, 64, 9, 4, 5.0, None, 8),
    "wan2.2-i2v-a14b": Preset(64, 64, 9, 6, 3.5, 3.5, 8),
    "wan2.2-animate": Preset(32, 32, 9, 3, 1.0, None, 8),
}
IMAGE_VARIANTS = ("wan2.1-i2v", "wan2.1-flf2v", "wan2.2-i2v-a14b")  # they need an image
PUBLISHED_MIN_WIDTH = 1536  # the narrowest published Wan DiT (Wan2.1-T2V-1.3B: 12 heads x 128)

# Wan's own default negative prompt (the one FastVideo's presets and the Wan repo use).
WAN_NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，"
    "丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，"
    "静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走"
)


def checkpoint_preset(variant: str, inner_dim: int, label: str, distilled: bool) -> Preset:
    """The preset of a checkpoint, from what it is, not what it is called. Rule: a DiT narrower than every
    published Wan DiT (``inner_dim`` below :data:`PUBLISHED_MIN_WIDTH`: the tiny models, wherever they are copied,
    quantized or renamed) gets its kind's :data:`TINY_PRESETS` entry, any other its kind's :data:`PRESETS` entry.
    The one place a name decides: Wan2.1-I2V-14B-480P and -720P share one config, so a checkpoint whose ``label``
    (its Hub id or folder name, lower case) says 720P (and not 480P) gets the 720P area. A DMD-distilled
    checkpoint samples with :data:`DMD_SETTINGS` (published widths: at :data:`DISTILLED_SIZES` where given)."""
    tiny = inner_dim < PUBLISHED_MIN_WIDTH
    if tiny:
        preset = TINY_PRESETS[variant]
    else:
        named_720p = variant == "wan2.1-i2v" and "720p" in label and "480p" not in label
        preset = PRESETS["wan2.1-i2v-720p" if named_720p else variant]
    if distilled:
        preset = replace(preset, **({} if tiny else DISTILLED_SIZES.get(variant, {})), **DMD_SETTINGS)
    return preset


def with_overrides(preset: Preset, **kw) -> Preset:
    return replace(preset, **{k: v for k, v in kw.items() if v is not None})


def runs_cfg(s) -> bool:
    """Rule: a video runs CFG (and encodes the negative prompt) when some expert's guidance scale is above 1; a
    step then runs the unconditional pass unless its expert's scale is exactly 1 (its prediction is the
    conditional one). diffusers looks at ``guidance_scale`` alone, ignoring ``guidance_scale_2`` when it is 1."""
    return s.guidance_scale > 1.0 or (s.guidance_scale_2 is not None and s.guidance_scale_2 > 1.0)
