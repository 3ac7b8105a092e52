"""An OpenAI ``POST /v1/videos`` body -> a :class:`~fastwan.GenerationRequest` checked against the loaded checkpoint.

The body is OpenAI's fields (``prompt``, ``model``, ``size``, ``seconds``, ``input_reference``) and, beside them,
fastwan's own :class:`~fastwan.GenerationRequest` fields (``negative_prompt``, ``seed``, ``num_inference_steps``,
``guidance_scale``, ``sampler``, ...), as JSON or as multipart form fields (the official client sends multipart,
whose values are text: each is read as its field's command-line text is, e.g. ``"2"`` -> 2). Rules:

- ``size`` "WxH" sets ``width`` and ``height``; ``seconds`` (a positive number, as text or a number) sets
  ``num_frames``: the frame count ``4k+1`` (the VAE's temporal factor times k, plus one) nearest to ``seconds``
  times the video's fps (the request's ``fps``, else the checkpoint's), halves rounded up. Giving ``size`` with
  ``width`` / ``height``, or ``seconds`` with ``num_frames``, is refused.
- An unknown field is refused, naming it. A request never names a server path or server-side behaviour:
  ``output_path``, ``image``, ``last_image``, ``video``, ``mask``, ``reference_images``, Animate's videos,
  ``save_video``, ``return_frames`` and ``overwrite`` are refused, and so is a ``cache`` that reads a file (the CLI's
  ``@FILE``); the first frame of image-to-video comes only as the uploaded file ``input_reference``, the last frame of
  a first-last-frame video only as the uploaded file ``last_image`` (beside ``input_reference``), VACE's mask and
  reference images only as the uploaded files ``mask`` and ``reference_images`` (:mod:`fastwan.serve.uploads`),
  Wan2.2-Animate's videos only as the uploaded files ``pose_video``, ``face_video``, ``background_video`` and
  ``mask_video`` (:mod:`fastwan.serve.animate_uploads`). ``prompt`` and ``negative_prompt`` are capped at 8 KiB.
- ``lora``: LoRAs by name, served from ``--lora-dir`` (:mod:`fastwan.serve.loras`).
- Every other rule is the request's own (:mod:`fastwan.pipelines.params`) and the checkpoint's
  (``gen.resolve``), checked before the job is accepted.
- ``seed``, when not given, is drawn here and stored with the job, so a job run again after a crash makes the
  same video.
"""
from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastwan.errors import UserError
from fastwan.fields import from_json, options
from fastwan.pipelines.inputs import random_seed
from fastwan.pipelines.params import GenerationRequest
from fastwan.pipelines.text import MAX_SEQUENCE_LENGTH
from fastwan.serve.errors import ApiError, from_user_error
from fastwan.serve.loras import JOB_KEY as LORA_KEY
from fastwan.serve.loras import ServedLoras
from fastwan.serve.loras import form_items as lora_form_items
from fastwan.serve.animate_uploads import ANIMATE_KEYS, animate_fields, animate_files, animate_inputs
from fastwan.serve.uploads import MASK_KEY, VACE_KEYS, refuse_uploads, vace_files, vace_inputs

OPENAI_FIELDS = ("prompt", "model", "size", "seconds", "input_reference")
SERVER_FIELDS = ("lora",)  # the server's own fields beside the request's (LoRAs by name)
SERVER_ONLY = {"output_path": "the server chooses where videos go", "image": "upload it as input_reference",
               "last_image": "upload the last frame as the file last_image (multipart), beside input_reference",
               "video": "upload the video as the file video (multipart)",
               "mask": "upload the mask video as the file mask (multipart), beside the file video",
               "reference_images": "upload each image as the file reference_images (multipart, the field repeated)",
               **{name: f"upload the {name.split('_')[0]} video as the file {name} (multipart), beside the character "
                        "image input_reference" for name in ANIMATE_KEYS},
               "save_video": "the server always writes the video", "return_frames": "frames are downloaded as the mp4",
               "overwrite": "the server chooses where videos go"}
REQUEST_FIELDS = {f.name: opt for f, opt in options(GenerationRequest)}


def names_files(schema) -> bool:
    """Rule: a field whose JSON form may be a path (a string the schema describes as a path, in any alternative or
    item) reads a file of the server's host; a client never names one: files come as multipart uploads."""
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string" and "path" in schema.get("description", ""):
        return True
    return any(names_files(s) for s in schema.get("anyOf", ())) or names_files(schema.get("items"))


HOST_FILE_FIELDS = frozenset(name for name, opt in REQUEST_FIELDS.items() if names_files(opt.schema))
MAX_PROMPT_CHARS = 8 * 1024  # well past 512 tokens of any text: a longer prompt is a mistake or an attack
MAX_SECONDS = 3600  # before the frame count is computed; the checkpoint's limit is far lower
LAST_IMAGE_KEY = "_last_image"  # the uploaded last frame's file in a job's stored fields
VIDEO_KEY = "_video"  # the uploaded video's file (video-to-video) in a job's stored fields
# a job's stored fields that are the server's, not the request's
JOB_KEYS = (LORA_KEY, LAST_IMAGE_KEY, VIDEO_KEY, *VACE_KEYS, *ANIMATE_KEYS.values())
SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")


@dataclass(frozen=True)
class Limits:
    """Caps on what a client sends: a JSON body's bytes, an upload's bytes, an image's decoded pixels."""

    max_body_bytes: int = 1 << 20
    max_upload_bytes: int = 20 << 20
    max_image_pixels: int = 4096 * 4096
    max_video_bytes: int = 256 << 20
    max_video_pixels: int = 1280 * 720 * 161  # all frames' pixels: 161 frames of 720p


@dataclass(frozen=True)
class Accepted:
    """A checked create: ``fields`` (the request's JSON form as the store keeps it), what the video object shows
    (``prompt``, ``size``, ``seconds``) and the decoded first frame (or None)."""

    fields: dict
    prompt: str
    size: str
    seconds: str
    image: Any


def _unique(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ApiError(400, f"the JSON body gives {key!r} twice; give each key once.", code="invalid_json",
                           param=key)
        seen[key] = value
    return seen


def json_body(data: bytes) -> dict:
    """A JSON create body -> its object (400 when it is not one JSON object)."""
    try:
        body = json.loads(data, object_pairs_hook=_unique)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc}); send one JSON object, e.g. "
                            '{"prompt": "a cat surfing", "size": "832x480", "seconds": "4"}.',
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body is a JSON {type(body).__name__}, not an object; send e.g. "
                            '{"prompt": "a cat surfing"}.', code="invalid_json")
    return body


def _scalar(text: str):
    """A form value inside an object (``cache[threshold]``): a JSON number, true, false or null as such, else text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if value is None or isinstance(value, (bool, int, float)) else text


def form_body(items: list[tuple[str, str]]) -> dict:
    """Multipart text fields -> typed values. The ``openai`` client spells a list as repeated ``name[]`` items and
    an object as ``name[key]`` items (a list in it: ``name[key][]``); a request field's text is read as its
    command-line text is (``parse``: "2" -> 2, "1000,500" -> [1000.0, 500.0]), an object's values as JSON scalars;
    other text stays text."""
    items, lora = lora_form_items(items)
    body: dict = {} if lora is None else {"lora": lora}
    grouped: dict[str, list[str]] = {}
    for key, value in items:
        grouped.setdefault(key, []).append(value)
    for key, values in grouped.items():
        member = re.fullmatch(r"(\w+)\[(\w+)\](\[\])?", key)  # name[key] or name[key][]
        name = member.group(1) if member else key[:-2] if key.endswith("[]") else key
        if len(values) > 1 and not key.endswith("[]"):
            raise ApiError(400, f"the form gives {key!r} {len(values)} times; give it once.", code="invalid_value",
                           param=name)
        text = ",".join(values)
        opt = REQUEST_FIELDS.get(name)
        if member is not None:
            if not isinstance(body.setdefault(name, {}), dict):
                raise ApiError(400, f"the form gives {name!r} both as text and as an object.", code="invalid_value",
                               param=name)
            values = [_scalar(v) for v in values]
            body[name][member.group(2)] = values if member.group(3) else values[0]
        elif name in body:
            raise ApiError(400, f"the form gives {name!r} twice.", code="invalid_value", param=name)
        elif opt is not None and opt.parse is not None and name not in SERVER_ONLY:
            try:
                body[name] = opt.parse(text)
            except (ValueError, TypeError) as exc:
                raise ApiError(400, f"{name}={text!r}: {exc}.", code="invalid_type", param=name) from None
        else:
            body[name] = text
    return body


def read_image(data: bytes, limits: Limits, param: str = "input_reference"):
    """An uploaded image (the file field ``param``) -> an RGB PIL image; 413 over the pixel cap (checked from the
    header, before decoding), 400 when it is not an image."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
    except Image.DecompressionBombError:
        raise ApiError(413, f"{param} has more than {limits.max_image_pixels} pixels; send a smaller image.",
                       code="image_too_large", param=param) from None
    except Exception as exc:  # noqa: BLE001 -- whatever PIL cannot read is the client's file
        raise ApiError(400, f"{param} is not an image this server reads ({type(exc).__name__}); upload a "
                            "PNG, JPEG or WebP file.", code="invalid_image", param=param) from None
    if width * height > limits.max_image_pixels:
        raise ApiError(413, f"{param} is {width}x{height} ({width * height} pixels), over this server's cap "
                            f"of {limits.max_image_pixels}; send a smaller image.", code="image_too_large",
                       param=param)
    try:
        return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001
        raise ApiError(400, f"{param} could not be decoded ({type(exc).__name__}: {exc}); upload a "
                            "complete PNG, JPEG or WebP file.", code="invalid_image", param=param) from None


def frames_for(seconds: float, fps: int, temporal: int) -> int:
    """The frame count ``temporal * k + 1`` (k >= 0) nearest to ``seconds * fps``, halves rounded up."""
    k = math.floor((seconds * fps - 1) / temporal + 0.5)
    return temporal * max(k, 0) + 1


def _seconds(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ApiError(400, f"seconds={value!r} must be a number of seconds such as \"4\".", code="invalid_type",
                       param="seconds")
    try:
        number = float(value)
    except ValueError:
        raise ApiError(400, f"seconds={value!r} is not a number; send e.g. \"4\".", code="invalid_type",
                       param="seconds") from None
    if not math.isfinite(number) or not 0 < number <= MAX_SECONDS:
        raise ApiError(400, f"seconds={value!r} must be a positive number of seconds up to {MAX_SECONDS}, e.g. \"4\" "
                            "(the checkpoint's own limit is checked next).", code="invalid_value", param="seconds")
    return number


def _size(value) -> tuple[int, int]:
    match = SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ApiError(400, f"size={value!r} must be 'WIDTHxHEIGHT' in pixels, e.g. \"832x480\".",
                       code="invalid_value" if isinstance(value, str) else "invalid_type", param="size")
    return int(match.group(1)), int(match.group(2))


def accept(body: dict, image, gen, model: str, output: Path, last_image=None, loras=None,
           video: Path | None = None, mask: Path | None = None, references: list | None = None,
           animate: dict | None = None) -> Accepted:
    """Check a create ``body`` (typed values; ``image`` / ``last_image``: the uploaded first / last frame or None)
    against ``gen`` (the loaded generator, serving ``model``); ``output``: where the server writes videos (the
    request is checked with it); ``loras``: the server's :class:`~fastwan.serve.loras.ServedLoras` (None: none);
    ``video`` / ``mask``: the uploaded videos' files; ``references``: the uploaded reference images (PIL);
    ``animate``: the uploaded Animate videos' files by field (:mod:`fastwan.serve.animate_uploads`).
    Raises an :class:`ApiError` (400) naming the first broken rule."""
    for key in body:
        if key in SERVER_ONLY:
            raise ApiError(400, f"{key!r} cannot be set by a client: {SERVER_ONLY[key]}.", code="unsupported_parameter",
                           param=key)
        if key in HOST_FILE_FIELDS:
            raise ApiError(400, f"{key!r} cannot be set by a client: it reads a file, and this server takes files only "
                           "as the uploads input_reference, last_image and video (multipart); it does not take "
                           f"{key!r} yet.", code="unsupported_parameter", param=key)
        if key not in REQUEST_FIELDS and key not in OPENAI_FIELDS and key not in SERVER_FIELDS:
            known = OPENAI_FIELDS + SERVER_FIELDS + tuple(
                k for k in REQUEST_FIELDS if k not in SERVER_ONLY and k not in HOST_FILE_FIELDS and k != "prompt")
            raise ApiError(400, f"{key!r} is not a field of this API; the fields are: {', '.join(known)}.",
                           code="unknown_parameter", param=key)
    if "prompt" not in body:
        raise ApiError(400, "prompt is required: what the video shows, e.g. \"a cat surfing a wave\".",
                       code="missing_required_parameter", param="prompt")
    for name in ("prompt", "negative_prompt"):
        if isinstance(body.get(name), str) and len(body[name]) > MAX_PROMPT_CHARS:
            raise ApiError(400, f"{name} is {len(body[name])} characters, over {MAX_PROMPT_CHARS}: the text encoder "
                                f"reads {MAX_SEQUENCE_LENGTH} tokens at most; shorten it.",
                           code="invalid_value", param=name)
    if "@" in json.dumps(body.get("cache")):  # the CLI's 'mag_ratios=@FILE' reads a file of the server
        raise ApiError(400, "cache names a file ('@...'); a request never names a server path: send the list inline, "
                            "e.g. 'magcache:mag_ratios=1.0/0.98/...'.", code="unsupported_parameter", param="cache")
    if "input_reference" in body:
        raise ApiError(400, "input_reference must be an uploaded image file (multipart/form-data), not a reference "
                            "object or text.", code="invalid_value", param="input_reference")
    if last_image is not None and image is None:
        raise ApiError(400, "last_image is the last frame of a first-last-frame video; upload the first frame as "
                            "input_reference beside it.", code="missing_required_parameter", param="last_image")
    refuse_uploads(gen.checkpoint, [name for name, v in (("mask", mask), ("reference_images", references)) if v],
                   "vace")
    if "model" in body and body["model"] != model:
        raise ApiError(400, f"model={body['model']!r}: this server serves {model!r}; leave model out or send "
                            f"{model!r}.", code="model_not_found", param="model")
    fields = {k: v for k, v in body.items() if k in REQUEST_FIELDS}
    if "size" in body:
        for name in ("width", "height"):
            if name in fields:
                raise ApiError(400, f"give size or {name}, not both.", code="invalid_value", param=name)
        fields["width"], fields["height"] = _size(body["size"])
    if "seconds" in body:
        if "num_frames" in fields:
            raise ApiError(400, "give seconds or num_frames, not both.", code="invalid_value", param="num_frames")
        fps = fields.get("fps")
        fps = fps if isinstance(fps, int) and not isinstance(fps, bool) and fps > 0 else gen.checkpoint.preset.fps
        fields["num_frames"] = frames_for(_seconds(body["seconds"]), fps, gen.vae_scale_factors[0])
    if fields.get("seed") is None:
        fields["seed"] = random_seed()
    if video is not None:  # the uploaded video's file, checked (check_video) and read by the request's rules
        fields[VIDEO_KEY] = str(video)
    if mask is not None:
        fields[MASK_KEY] = str(mask)
    fields.update(animate_fields(animate or {}))
    try:
        request = build(fields, output, image, last_image, references)
        resolved = gen.resolve(request)
    except UserError as exc:
        error = from_user_error(exc)
        if error.param == "image":  # the upload's field
            error.param = "input_reference"
        if error.param in ("width", "height") and "size" in body:  # the field the client sent
            error.param, error.message = "size", f"{error.message} (size={body['size']!r} sets width and height)"
        elif error.param == "num_frames" and "seconds" in body:
            error.param, error.message = "seconds", (f"{error.message} (seconds={body['seconds']!r} sets num_frames="
                                                     f"{fields['num_frames']}: the 4k+1 count nearest seconds x fps)")
        raise error from None
    if "lora" in body:
        fields[LORA_KEY] = (loras or ServedLoras(None)).check(body["lora"], gen.checkpoint)
    s = resolved.settings
    # an Animate video's frames are the driving videos' (its settings' are what the DiT denoises per segment)
    frames = s.num_frames if resolved.animate is None else resolved.animate.plan.frames
    seconds = str(body["seconds"]) if "seconds" in body else f"{frames / s.fps:g}"
    return Accepted(fields, request.prompt, f"{s.width}x{s.height}", seconds, image)


def build(fields: dict, output: Path, image, last_image=None, references=None) -> GenerationRequest:
    """The request of a job: its stored ``fields`` (the server's own, :data:`JOB_KEYS`, read for the uploads' files),
    the server's ``output`` (a .mp4 path, replaced if a former run of the job left it), the first and last frames
    ``image`` and ``last_image`` (PIL images or None) and VACE's reference images (PIL images; None: the stored
    files). Animate's videos are read with the request's fields (its rules take them together)."""
    request = from_json(GenerationRequest, {**{k: v for k, v in fields.items() if k not in JOB_KEYS},
                                            **animate_inputs(fields), "output_path": str(output), "overwrite": True})
    inputs = {k: v for k, v in (("image", image), ("last_image", last_image), ("video", fields.get(VIDEO_KEY)))
              if v is not None}
    inputs.update(vace_inputs(fields, references))
    return request.replace(**inputs) if inputs else request


def uploads(job) -> tuple[str | None, ...]:
    """The files of a job's uploads: its first and last frames, its video (None: not uploaded), VACE's mask
    (None: not uploaded) and reference images, then Animate's videos (None: not uploaded)."""
    return (job.image, job.fields.get(LAST_IMAGE_KEY), job.fields.get(VIDEO_KEY), *vace_files(job.fields),
            *animate_files(job.fields))


def check_video(path: Path, limits: Limits, param: str = "video") -> None:
    """An uploaded video (the file field ``param``: ``video``, VACE's ``mask``, Animate's videos), decoded frame by
    frame (one in memory at a time) before the request is checked: 400 when it is no readable video or has no frame,
    413 when a frame is over the pixel cap or the frames together are over ``max_video_pixels`` (or more than the
    frames a request may have)."""
    import imageio.v3 as iio

    from fastwan.pipelines.video import MAX_VIDEO_FRAMES

    frames = total = 0
    try:
        for frame in iio.imiter(path):
            frames += 1
            pixels = int(frame.shape[0]) * int(frame.shape[1])
            total += pixels
            if pixels > limits.max_image_pixels:
                raise ApiError(413, f"{param}'s frames are {frame.shape[1]}x{frame.shape[0]}, over this server's cap "
                                    f"of {limits.max_image_pixels} pixels a frame.", code="video_too_large",
                               param=param)
            if total > limits.max_video_pixels or frames > MAX_VIDEO_FRAMES:
                raise ApiError(413, f"{param} holds more than {min(frames, MAX_VIDEO_FRAMES)} frames or "
                                    f"{limits.max_video_pixels} pixels in all, over this server's caps; cut it to "
                                    "the frames to redo (4k+1 of them, e.g. 81).", code="video_too_large",
                               param=param)
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 -- any decoder failure is the upload's
        raise ApiError(400, f"{param} is not a readable video ({type(exc).__name__}); upload an mp4 (or a file ffmpeg "
                            "reads).", code="invalid_value", param=param) from None
    if frames == 0:
        raise ApiError(400, f"{param} has no frames; upload a video of 4k+1 frames (e.g. 81).", code="invalid_value",
                       param=param)


def job_images(job) -> tuple:
    """A job's uploaded first and last frames as RGB PIL images (None: not uploaded)."""
    from PIL import Image

    images = []
    for path in uploads(job)[:2]:
        if path is None:
            images.append(None)
            continue
        with Image.open(path) as im:
            images.append(im.convert("RGB"))
    return tuple(images)
