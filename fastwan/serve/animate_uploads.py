"""Wan2.2-Animate's uploads in a create: the driving videos ``pose_video`` and ``face_video`` and, in replace mode,
``background_video`` and ``mask_video`` (multipart files), beside the character image (the upload
``input_reference``, the request's ``image``) and the plain fields ``mode``, ``segment_frames``, ``overlap`` and
``motion_batch_size`` (form or JSON values, read as the request's other fields are).

Rules:

- Each video is one file, saved to the data folder's ``uploads`` and read frame by frame like ``video``
  (:func:`~fastwan.serve.requests.check_video`), then checked by the checkpoint's Animate rules (``gen.resolve``:
  the driving videos of one length, the mask of the background's size, ...); a rule's error carries the field it
  is about (its ``field``, the API error's ``param``).
- They are Animate's only: on another checkpoint they are refused (400 naming the first) before anything else is
  read. Their JSON and form text forms (a path on the server's host) stay refused.
- They are stored with the job (their files named in the job's fields, :data:`ANIMATE_KEYS`) and removed with its
  other uploads. VACE's upload ``mask`` is another field (:mod:`fastwan.serve.uploads`).
"""
from __future__ import annotations

from types import MappingProxyType

ANIMATE_UPLOADS = ("pose_video", "face_video", "background_video", "mask_video")  # the Animate file fields
# each upload's file in a job's stored fields
ANIMATE_KEYS = MappingProxyType({name: f"_{name}" for name in ANIMATE_UPLOADS})


def animate_fields(videos: dict) -> dict:
    """The stored fields naming the uploaded Animate ``videos`` (their files by field)."""
    return {ANIMATE_KEYS[name]: str(path) for name, path in videos.items() if name in ANIMATE_KEYS}


def animate_inputs(fields: dict) -> dict:
    """The request's Animate videos of a job's stored ``fields`` (their files)."""
    return {name: fields[key] for name, key in ANIMATE_KEYS.items() if fields.get(key)}


def animate_files(fields: dict) -> tuple:
    """The files of a job's Animate uploads (None: not uploaded)."""
    return tuple(fields.get(key) for key in ANIMATE_KEYS.values())

