"""The one typed request of a video: :class:`GenerationRequest`, every argument of ``generate_video``.

The Python API (``generate_video(prompt, **kw)`` builds one; ``gen.generate(request)`` takes one), the CLI (its
flags and their help come from these fields, :mod:`fastwan.fields`) and JSON callers (:func:`~fastwan.fields.to_json`
/ :func:`~fastwan.fields.from_json`, :func:`~fastwan.fields.json_schema`) share it. Building one checks every rule
that needs no checkpoint (types, ranges, the output path); the rules of a checkpoint (size multiples, the scheduler's
step limit, the preset that fills each unset field, the image a checkpoint needs) are checked when a generator
resolves it (:func:`fastwan.pipelines.request.resolve_request`), before any compute.

Rule for numbers (:func:`fastwan.values.python_number`): a NumPy scalar, or a 0-d NumPy array / torch tensor, stands
for the Python number it holds; a bool is never a number; nothing else is converted (``480.0`` is not a size,
``"5"`` not a scale).
"""
from __future__ import annotations

import base64
import dataclasses
import io
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastwan.cache import CACHES, check_cache
from fastwan.cache.schema import cache_schema
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.fields import REQUIRED, boolean, check_fields, checked, integer_text, number_text, option, options
from fastwan.parallel.chords import PARALLEL_SAMPLING, check_cores, check_init, check_parallel_sampling
from fastwan.pipelines.animate import (MODES, OVERLAPS, check_animate_fields, check_mode, check_motion_batch_size,
                                      check_overlap, check_segment_frames)
from fastwan.pipelines.inputs import MAX_FPS, SEED_LIMIT, finite_float, is_int
from fastwan.pipelines.output import check_output_path
from fastwan.pipelines.sampling import SAMPLERS, _check_timesteps, check_flow_shift, check_sampler
from fastwan.pipelines.text import clean_prompt
from fastwan.pipelines.video import check_strength
from fastwan.values import python_number

IMAGE_DATA_URL = "data:image/png;base64,"  # an image's JSON form when it is pixels rather than a file path


# ---- field rules (each: the given value -> its normal form, or a user error naming it) -------------------------
def _prompt(value):
    if not isinstance(value, str):
        raise InvalidArgumentType(f"prompt={value!r} must be a string.")
    if not clean_prompt(value):  # what the text encoder reads: HTML entities decoded, whitespace dropped
        raise InvalidArgument(f"prompt={value!r} is empty once cleaned as the text encoder reads it (HTML entities "
                              "decoded, whitespace dropped); describe the video to generate, e.g. 'a cat surfing a "
                              "wave'.")
    return value


def _negative_prompt(value):
    if value is not None and not isinstance(value, str):
        raise InvalidArgumentType(f"negative_prompt={value!r} must be a string or None (Wan's default).")
    return value


def _count(name: str, example: int, most: int | None = None):
    """The rule of a whole-number field: None (the preset's) or an int in [1, most]."""
    def check(value):
        if value is None:
            return None
        value = python_number(value)
        if not is_int(value):
            raise InvalidArgumentType(f"{name}={value!r} must be an int >= 1 (e.g. {example}).")
        if most is not None and not 1 <= value <= most:
            raise InvalidArgument(f"{name}={value!r} must be an int in [1, {most}] (e.g. {example}).")
        if value < 1:
            raise InvalidArgument(f"{name}={value!r} must be >= 1 (a positive int, e.g. {example}).")
        return int(value)
    return check


def _scale(name: str):
    def check(value):
        if value is None:
            return None
        value = python_number(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgumentType(f"{name}={value!r} must be a number (a float >= 0).")
        number = finite_float(value)
        if number is None or number < 0:
            raise InvalidArgument(f"{name}={value!r} must be finite and >= 0; e.g. 5.0 (1.0 or less disables CFG).")
        return value
    return check


def _seed(value):
    """None (a new random seed) or an int in [0, 2**64); bool is not a seed."""
    if value is None:
        return None
    value = python_number(value)
    if not is_int(value):
        raise InvalidArgumentType(f"seed={value!r} must be an int in [0, 2**64) (e.g. 0), or None for a random seed.")
    if not 0 <= int(value) < SEED_LIMIT:
        raise InvalidArgument(f"seed={value} must be >= 0 and < 2**64 (e.g. 0); leave it unset for a random seed.")
    return int(value)


def _optional(rule):
    """``rule`` for a field whose None means "the preset's / the sampler's own"."""
    def check(value):
        return None if value is None else rule(value)
    return check


def _output_path(value):
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidArgumentType(f"output_path={value!r} must be a path: a folder, or a file ending in .mp4.")
    return value


def _cache(value):
    """None: the generator's default step cache; "none": no cache; else a config (its string form parsed)."""
    if value is None:
        return None
    config = check_cache(value)
    return "none" if config is None else config


def _encode_cache(value):
    if isinstance(value, str):
        return value
    return {"type": value.name, **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _decode_cache(value):
    if isinstance(value, dict):
        kind = value.get("type")
        if kind not in CACHES:
            raise InvalidArgument(f"cache={value!r}: 'type' must be one of {sorted(CACHES)}, e.g. "
                                  "{'type': 'teacache', 'threshold': 0.1}.")
        settings = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items() if k != "type"}
        try:
            return CACHES[kind](**settings)
        except TypeError:
            names = [f.name for f in dataclasses.fields(CACHES[kind])]
            raise InvalidArgument(f"cache={value!r}: {kind} takes the settings {names}.") from None
    return value


def _encode_image(value):
    """A file path as its text; pixels (a PIL image or an np.uint8 array) as a PNG data URL (lossless)."""
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    from PIL import Image

    image = Image.fromarray(value) if isinstance(value, np.ndarray) else value
    if not isinstance(image, Image.Image):
        raise InvalidArgumentType(f"an image of type {type(value).__name__} has no JSON form; give a PIL image, an "
                                  "np.uint8 array or a file path.")
    buf = io.BytesIO()
    image.save(buf, format="PNG", exif=image.getexif())
    return IMAGE_DATA_URL + base64.b64encode(buf.getvalue()).decode("ascii")


def _decode_image(value):
    if not isinstance(value, str):
        raise InvalidArgumentType(f"an image's JSON form is a string (a file path or a {IMAGE_DATA_URL}... data URL), "
                                  f"not {type(value).__name__}.")
    if not value.startswith("data:"):
        return value
    from PIL import Image

    if not value.startswith(IMAGE_DATA_URL):
        raise InvalidArgument(f"image data URL {value[:40]!r}...: only {IMAGE_DATA_URL}<base64> is read.")
    try:
        data = base64.b64decode(value[len(IMAGE_DATA_URL):], validate=True)
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as exc:  # noqa: BLE001 -- any decoding failure is the caller's data
        raise InvalidArgument(f"image data URL: not a readable PNG ({type(exc).__name__}: {exc}).") from None
    return image


def _frames(name: str):
    """The rule of a video-like field: None, a file path, a sequence of images or an np.uint8 array of frames (read
    when the request is resolved)."""
    def check(value):
        if value is None or isinstance(value, (str, os.PathLike, np.ndarray, list, tuple)):
            return value
        raise InvalidArgumentType(f"{name}={value!r} must be a video file path, a list of images, or an np.uint8 "
                                  "array T x H x W x 3.")
    return check


def _images(value):
    """VACE's reference images: None, or one image or a list of them (paths, PIL images, np.uint8 arrays) -> a
    tuple (each read when the request is resolved)."""
    if value is None:
        return None
    images = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return images or None


def _conditioning_scale(value):
    """None (1 for every VACE layer), a number, or one number per VACE layer; finite."""
    if value is None:
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    numbers = [python_number(v) for v in items]
    if not numbers or any(isinstance(v, bool) or not isinstance(v, (int, float)) or finite_float(v) is None
                          for v in numbers):
        raise InvalidArgumentType(f"conditioning_scale={value!r} must be a finite number (e.g. 1.0) or a list of "
                                  "them, one per VACE layer.")
    return tuple(float(v) for v in numbers) if isinstance(value, (list, tuple)) else float(numbers[0])


def _encode_video(value):
    """A file path as its text; frames as a list of PNG data URLs (lossless)."""
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    return [_encode_image(frame) for frame in value]


def _decode_video(value):
    if isinstance(value, list):
        return [_decode_image(frame) for frame in value]
    if not isinstance(value, str) or value.startswith("data:"):
        raise InvalidArgumentType(f"a video's JSON form is a file path or a list of {IMAGE_DATA_URL}... frames, not "
                                  f"{type(value).__name__}.")
    return value


def steps_text(text: str) -> list[int]:
    """--chords-init '0,2,4,8' -> [0, 2, 4, 8] (the request checks the values). Rule: whole numbers separated by
    commas."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not whole numbers separated by commas, e.g. 0,2,4,8") from None


def scales_text(text: str):
    """--conditioning-scale '0.5' -> 0.5, '1,0.5' -> [1.0, 0.5] (one per VACE layer; the request checks the values).
    Rule: one number, or numbers separated by commas."""
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not a number or numbers separated by commas, e.g. 1.0 or 1.0,0.5") from None
    return values[0] if len(values) == 1 else values


def timesteps_text(text: str) -> list[float]:
    """--timesteps '1000,757,522' -> [1000.0, 757.0, 522.0] (the request checks the values). Rule: numbers
    separated by commas, each item one number (spaces around it allowed); an error names the first item that is
    not."""
    items, values = text.split(","), []
    for i, item in enumerate(items, 1):
        try:
            values.append(float(item))
        except ValueError:
            what = "is empty" if not item.strip() else f"{item.strip()!r} is not a number"
            raise ValueError(f"{text!r}: item {i} of {len(items)} {what}; pass numbers separated by commas, e.g. "
                             "1000,757,522") from None
    return values



_TYPE = {"integer": {"type": "integer", "minimum": 1}, "number": {"type": "number", "minimum": 0}}
_IMAGE_SCHEMA = {"type": "string", "description": "a file path or a data:image/png;base64 URL"}
_VIDEO_SCHEMA = {"anyOf": [{"type": "string", "description": "a video file path"},
                           {"type": "array", "items": _IMAGE_SCHEMA, "minItems": 1}]}


@dataclass(frozen=True)
class GenerationRequest:
    """One video: every argument of ``VideoGenerator.generate_video``; None fields take the checkpoint's preset.

    Built once, checked once (types and ranges here; the checkpoint's rules when a generator resolves it), read by
    the Python API, the CLI and JSON callers alike."""

    prompt: str = option(REQUIRED, help="what the video shows", schema={"type": "string", "minLength": 1},
                         check=_prompt, flag="--prompt")
    image: Any = option(None, help="first frame (image-to-video checkpoints): an image file", nullable=True,
                        schema=_IMAGE_SCHEMA, encode=_encode_image, decode=_decode_image, flag="--image")
    last_image: Any = option(None, help="last frame (first-last-frame checkpoints): an image file", nullable=True,
                             schema=_IMAGE_SCHEMA, encode=_encode_image, decode=_decode_image, flag="--last-image")
    video: Any = option(None, help="video-to-video: the video to redo (a file, e.g. .mp4; its frame count is the "
                                   "video's; text-to-video checkpoints); VACE: the control video", nullable=True,
                        schema=_VIDEO_SCHEMA,
                        check=_frames("video"), encode=_encode_video, decode=_decode_video, flag="--video")
    mask: Any = option(None, help="VACE: which pixels of --video are generated (white) or kept (black), a video of "
                                  "its frames and size", nullable=True, schema=_VIDEO_SCHEMA, check=_frames("mask"),
                       encode=_encode_video, decode=_decode_video, flag="--mask")
    reference_images: Any = option(None, help="VACE: a reference image (repeat the flag for more)", nullable=True,
                                   schema={"type": "array", "items": _IMAGE_SCHEMA, "minItems": 1}, check=_images,
                                   encode=lambda v: [_encode_image(i) for i in v],
                                   decode=lambda v: [_decode_image(i) for i in v], flag="--reference-image",
                                   action="append", metavar="PATH")
    conditioning_scale: Any = option(None, help="VACE: the control hints' scale, a number or one per VACE layer "
                                                "(default 1)", nullable=True,
                                     schema={"anyOf": [{"type": "number"}, {"type": "array", "items":
                                                                          {"type": "number"}, "minItems": 1}]},
                                     check=_conditioning_scale, encode=lambda v: list(v) if isinstance(v, tuple)
                                     else v, flag="--conditioning-scale", parse=scales_text)
    pose_video: Any = option(None, help="Wan2.2-Animate: the driving pose video (its frame count is the video's)",
                             nullable=True, schema=_VIDEO_SCHEMA, check=_frames("pose_video"), encode=_encode_video,
                             decode=_decode_video, flag="--pose-video")
    face_video: Any = option(None, help="Wan2.2-Animate: the driving face video, one frame per pose frame",
                             nullable=True, schema=_VIDEO_SCHEMA, check=_frames("face_video"), encode=_encode_video,
                             decode=_decode_video, flag="--face-video")
    mode: str | None = option(None, help="Wan2.2-Animate: animate (default; the image moves) or replace (it replaces "
                                         "the character of --background-video)", nullable=True,
                              schema={"enum": list(MODES)}, check=check_mode, flag="--mode", choices=MODES)
    background_video: Any = option(None, help="Wan2.2-Animate replace mode: the video whose character is replaced",
                                   nullable=True, schema=_VIDEO_SCHEMA, check=_frames("background_video"),
                                   encode=_encode_video, decode=_decode_video, flag="--background-video")
    mask_video: Any = option(None, help="Wan2.2-Animate replace mode: the character's mask (white: redrawn), a "
                                        "video of --background-video's frames and size", nullable=True,
                             schema=_VIDEO_SCHEMA, check=_frames("mask_video"), encode=_encode_video,
                             decode=_decode_video, flag="--mask-video")
    segment_frames: int | None = option(None, help="Wan2.2-Animate: frames per segment, 4k+1 (default 77)",
                                        nullable=True, schema=_TYPE["integer"], check=check_segment_frames,
                                        flag="--segment-frames", parse=integer_text)
    overlap: int | None = option(None, help="Wan2.2-Animate: frames of a segment that condition the next, 1 or 5 "
                                            "(default 1)", nullable=True, schema={"enum": list(OVERLAPS)},
                                 check=check_overlap, flag="--overlap", parse=integer_text)
    motion_batch_size: int | None = option(None, help="Wan2.2-Animate: face frames the motion encoder reads at once "
                                                      "(default: the checkpoint's)", nullable=True,
                                           schema=_TYPE["integer"], check=check_motion_batch_size,
                                           flag="--motion-batch-size", parse=integer_text)
    strength: float | None = option(None, help="video-to-video: how much of the video is redone, in (0, 1] (1: "
                                               "from pure noise; default 0.8)", nullable=True,
                                    schema={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                                    check=check_strength, flag="--strength", parse=number_text)
    negative_prompt: str | None = option(None, help="what the video avoids (default: Wan's negative prompt)",
                                         nullable=True, schema={"type": "string"}, check=_negative_prompt,
                                         flag="--negative-prompt")
    height: int | None = option(None, help="video height in pixels, a multiple of the VAE factor x patch (e.g. 480; "
                                           "default: the preset's)", nullable=True, schema=_TYPE["integer"],
                                check=_count("height", 480), flag="--height", parse=integer_text)
    width: int | None = option(None, help="video width in pixels, a multiple of the VAE factor x patch (e.g. 832; "
                                          "default: the preset's)", nullable=True, schema=_TYPE["integer"],
                               check=_count("width", 832), flag="--width", parse=integer_text)
    num_frames: int | None = option(None, help="frames, 4k+1 (e.g. 81; default: the preset's)", nullable=True,
                                    schema=_TYPE["integer"], check=_count("num_frames", 81), flag="--num-frames",
                                    parse=integer_text)
    num_inference_steps: int | None = option(None, help="denoising steps (default: the preset's)", nullable=True,
                                             schema=_TYPE["integer"], check=_count("num_inference_steps", 50),
                                             flag="--steps", parse=integer_text)
    guidance_scale: float | None = option(None, help="classifier-free guidance scale, >= 0 (1 or less: no CFG; "
                                                     "default: the preset's)", nullable=True,
                                          schema=_TYPE["number"], check=_scale("guidance_scale"),
                                          flag="--guidance-scale", parse=number_text)
    guidance_scale_2: float | None = option(None, help="the low-noise expert's scale (Wan2.2 A14B; default: "
                                                       "--guidance-scale when given, else the preset's)",
                                            nullable=True, schema=_TYPE["number"], check=_scale("guidance_scale_2"),
                                            flag="--guidance-scale-2", parse=number_text)
    seed: int | None = option(None, help="random seed, an int in [0, 2**64) (default: a new random one, reported)",
                              nullable=True, schema={"type": "integer", "minimum": 0, "maximum": SEED_LIMIT - 1},
                              check=_seed, flag="--seed", parse=integer_text)
    fps: int | None = option(None, help=f"frames per second of the mp4, 1..{MAX_FPS} (default: the preset's)",
                             nullable=True, schema={"type": "integer", "minimum": 1, "maximum": MAX_FPS},
                             check=_count("fps", 16, MAX_FPS), flag="--fps", parse=integer_text)
    output_path: str = option("outputs/", help="a folder (the file gets an automatic name), or a path ending in .mp4",
                              schema={"type": "string"}, check=_output_path, encode=os.fspath, flag="--output")
    save_video: bool = option(True, help="write the mp4", schema={"type": "boolean"}, check=boolean("save_video"))
    return_frames: bool = option(True, help="return the frames as an array", schema={"type": "boolean"},
                                 check=boolean("return_frames"))
    overwrite: bool = option(False, help="replace an existing video at the output path", schema={"type": "boolean"},
                             check=boolean("overwrite"), flag="--overwrite", action="store_true")
    cache: Any = option(None, help="this video's step cache (fastwan.cache; 'none': off; default: the generator's)",
                        nullable=True, schema=cache_schema(), check=_cache,
                        encode=_encode_cache, decode=_decode_cache)
    sampler: str | None = option(None, help="default (the checkpoint's scheduler), euler (step-distilled LoRAs) or "
                                            "dmd (FastWan); default: the checkpoint's", nullable=True,
                                 schema={"enum": list(SAMPLERS)}, check=_optional(check_sampler), flag="--sampler",
                                 choices=SAMPLERS)
    timesteps: tuple[float, ...] | None = option(
        None, help="euler / dmd timesteps in (0, 1000], decreasing, e.g. 1000,757,522 (sets the step count)",
        nullable=True, schema={"type": "array", "items": {"type": "number"}, "minItems": 1},
        check=_optional(_check_timesteps), encode=list, flag="--timesteps", parse=timesteps_text, metavar="T1,T2,...")
    flow_shift: float | None = option(None, help="the sampler's flow shift, > 0 (default: the preset's, else 8 for "
                                                 "dmd and the checkpoint scheduler's otherwise)", nullable=True,
                                      schema={"type": "number", "exclusiveMinimum": 0}, check=check_flow_shift,
                                      flag="--flow-shift", parse=number_text)
    parallel_sampling: str | None = option(None, help="step-parallel sampling: 'chords' (CHORDS, with chords_cores; "
                                                      "default: none, sequential)", nullable=True,
                                           schema={"enum": list(PARALLEL_SAMPLING)},
                                           check=_optional(check_parallel_sampling))
    chords_cores: int | None = option(None, help="CHORDS step-parallel sampling with K cores, K >= 1, euler sampler "
                                                 "only (frames differ from sequential sampling; see docs/parallel.md)",
                                      nullable=True, schema={"type": "integer", "minimum": 1},
                                      check=_optional(check_cores), flag="--chords", parse=integer_text, metavar="K")
    chords_init: tuple[int, ...] | None = option(
        None, help="CHORDS: the step each core starts at, from 0, increasing, e.g. 0,2,4,8 (sets chords_cores; "
                   "default: the published 8-core schedule's first K points scaled to the steps)", nullable=True,
        schema={"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        check=_optional(check_init), encode=list, flag="--chords-init", parse=steps_text, metavar="S0,S1,...")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.chords_init is not None and self.chords_cores is None:  # one core per start step
            object.__setattr__(self, "chords_cores", len(self.chords_init))
        if self.chords_cores is not None and self.parallel_sampling is None:  # --chords K alone asks for CHORDS
            object.__setattr__(self, "parallel_sampling", "chords")
        if self.parallel_sampling == "chords" and self.chords_cores is None:
            raise InvalidArgument("parallel_sampling='chords' needs chords_cores=K (the number of cores, e.g. 4).",
                                  field="parallel_sampling")
        check_animate_fields(self)
        check_output_path(self.output_path, self.overwrite)

    def replace(self, **changes) -> GenerationRequest:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)


def check_field(name: str, value):
    """``value`` checked by the rule of :class:`GenerationRequest`'s field ``name`` -> its normal form (raises the
    field's user error): the one rule of a field for a caller that takes it outside a request."""
    (rule,) = [opt.check for f, opt in options(GenerationRequest) if f.name == name]
    return value if rule is None else checked(name, rule, value)
