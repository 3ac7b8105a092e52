"""Checkpoint I/O: from a model argument to checked files, and the files' tensors.

* :mod:`~fastwan.checkpoint.resolver`: a Hub id, a folder or a tiny id to a checked Diffusers-format Wan
  checkpoint (:func:`resolve`, :class:`Checkpoint`), ``model_index.json`` read and checked (:func:`pipeline_index`);
* :mod:`~fastwan.checkpoint.presets`: the generation defaults (:class:`Preset`) of each kind of model;
* :mod:`~fastwan.checkpoint.hub`: the Hub download of the files fastwan reads;
* :mod:`~fastwan.checkpoint.components`: the checks of the components diffusers and transformers load;
* :mod:`~fastwan.checkpoint.safetensors`: weight files found, checked from their headers and loaded (pickle only
  when allowed), JSON files read;
* :mod:`~fastwan.checkpoint.causal`, :mod:`~fastwan.checkpoint.causal_layouts`,
  :mod:`~fastwan.checkpoint.causal_files`: causal checkpoints: their sampling rule (:class:`CausalRecipe`), FastVideo's
  ``WanCausalDMDPipeline`` layout and each family's published rule, Self-Forcing's / CausVid's generator files;
* :mod:`~fastwan.checkpoint.tiny`: tiny random checkpoints (``--model tiny``, the tests);
* :mod:`~fastwan.checkpoint.files`: new temporary files and folders with the umask's modes.

Layers: ``files`` and ``safetensors`` sit below the models (the DiT and the VAE load through them); the rest sits
above the models (it reads their configs). So this ``__init__`` imports nothing eagerly: a name below is imported
on first use, and importing :mod:`fastwan.checkpoint.safetensors` from a model does not pull the upper modules in.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Checkpoint": "resolver", "PipelineIndex": "resolver", "pipeline_index": "resolver", "resolve": "resolver",
    "PRESETS": "presets", "TINY_PRESETS": "presets", "Preset": "presets", "with_overrides": "presets",
    "CheckpointTensors": "safetensors", "read_json": "safetensors", "weight_files": "safetensors",
    "TINY_IDS": "tiny", "tiny_checkpoint": "tiny", "write_hub_cache": "tiny", "write_tiny_checkpoint": "tiny",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"fastwan.checkpoint.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'fastwan.checkpoint' has no attribute {name!r}")
