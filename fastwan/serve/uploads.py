"""VACE's uploads in a create: the ``mask`` video and the ``reference_images`` (multipart files), beside the control
video (the upload ``video``) and ``conditioning_scale`` (a form or JSON number, or a list of them).

Rules:

- ``mask``: one video file, read frame by frame like ``video`` (:func:`~fastwan.serve.requests.check_video`), then
  by the checkpoint's VACE rules (``gen.resolve``: one mask frame per video frame, the video's frame size), whose
  errors name ``mask`` as their field.
- ``reference_images``: one to :data:`MAX_REFERENCE_IMAGES` image files, the field repeated (``reference_images``
  or, as clients spell a list, ``reference_images[]``), each read as ``input_reference`` is.
- Both are VACE's only: on another checkpoint they are refused (400 naming the field) before anything is read
  further. Their JSON forms (a path on the server's host) stay refused.
- They are stored with the job (the mask and the images in the data folder's ``uploads``, their files named in the
  job's fields) and removed with its other uploads.
"""
from __future__ import annotations

from types import MappingProxyType

from fastwan.serve.errors import ApiError

MASK_KEY = "_mask"  # the uploaded mask video's file in a job's stored fields
REFERENCES_KEY = "_reference_images"  # the uploaded reference images' files (a list) in a job's stored fields
VACE_KEYS = (MASK_KEY, REFERENCES_KEY)
MASK = "mask"
REFERENCES = "reference_images"
VACE_UPLOADS = (MASK, REFERENCES)  # the VACE file fields of a create
MAX_REFERENCE_IMAGES = 4  # VACE's reference images are a subject or a background or two; more is a mistake
# the models whose uploads a create refuses on another checkpoint, by their DiT config's flag: the model's name, an
# example checkpoint, the server to send them to
UPLOAD_MODELS = MappingProxyType({
    "vace": ("VACE", "Wan-AI/Wan2.1-VACE-1.3B-diffusers", "a VACE model"),
    "animate": ("Wan2.2-Animate", "Wan-AI/Wan2.2-Animate-14B-Diffusers", "an Animate model")})


def file_field(key: str) -> str:
    """A multipart file field's name as the API reads it: ``reference_images[]`` (a client's list) is
    ``reference_images``."""
    return REFERENCES if key == f"{REFERENCES}[]" else key


def check_count(references: list) -> None:
    if len(references) > MAX_REFERENCE_IMAGES:
        raise ApiError(400, f"{len(references)} reference_images uploaded; VACE takes 1 to {MAX_REFERENCE_IMAGES}: "
                            "send fewer.", code="invalid_value", param=REFERENCES)


def refuse_uploads(checkpoint, given: list[str], kind: str) -> None:
    """400 naming the first upload in ``given`` when ``checkpoint``'s DiT is not of ``kind`` (a key of
    :data:`UPLOAD_MODELS`: its DiT config's flag)."""
    if given and not getattr(checkpoint.transformer_config, kind):
        model, example, server = UPLOAD_MODELS[kind]
        raise ApiError(400, f"{' and '.join(given)} uploaded, but this server's model ({checkpoint.variant}) is not a "
                            f"{model} checkpoint; they are inputs of {model} (e.g. {example}): leave them out, or send "
                            f"them to a server of {server}.", code="unsupported_parameter", param=given[0])


def vace_inputs(fields: dict, references=None) -> dict:
    """The request's ``mask`` and ``reference_images`` of a job's stored ``fields`` (their files);
    ``references``: the decoded images instead of the stored files (while the create is checked)."""
    inputs = {"mask": fields.get(MASK_KEY), "reference_images": references or fields.get(REFERENCES_KEY)}
    return {k: v for k, v in inputs.items() if v}


def vace_files(fields: dict) -> tuple:
    """The files of a job's VACE uploads: its mask (None: not uploaded) and its reference images."""
    return fields.get(MASK_KEY), *fields.get(REFERENCES_KEY, ())

