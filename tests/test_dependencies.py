"""Runtime dependencies: accelerate is required unconditionally, so loading a model never warns that it is missing.

diffusers loads models with ``low_cpu_mem_usage`` through accelerate; without it, every load logs "Cannot
initialize model with low cpu memory usage because `accelerate` was not found in the environment".
"""
import importlib.metadata
import logging
import warnings

import torch
from packaging.requirements import Requirement

from fastwan import VideoGenerator

def unconditional(requirements) -> set[str]:
    """Names of the requirements that apply without an extra (no ``extra == ...`` in their marker)."""
    names = set()
    for text in requirements:
        req = Requirement(text)
        if req.marker is None or "extra" not in str(req.marker):
            names.add(req.name.lower())
    return names


def test_accelerate_is_a_runtime_dependency():
    # the installed metadata: after editing pyproject.toml, reinstall (pip install -e . --no-deps)
    assert "accelerate" in unconditional(importlib.metadata.requires("fastwan") or [])


class Records(logging.Handler):
    """Keeps every log record's message."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_loading_and_generating_do_not_warn_about_accelerate(tiny_ckpts):
    handler = Records()
    # diffusers' and transformers' library loggers do not propagate to the root logger: listen on each
    loggers = [logging.getLogger(name) for name in ("", "diffusers", "transformers", "accelerate", "fastwan")]
    for log in loggers:
        log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gen = VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32)
            gen.generate_video("a kite", height=64, width=64, num_frames=5, num_inference_steps=1, seed=0,
                               save_video=False)
    finally:
        for log in loggers:
            log.removeHandler(handler)
    messages = handler.messages + [str(w.message) for w in caught]
    assert not [m for m in messages if "accelerate" in m.lower()], messages
