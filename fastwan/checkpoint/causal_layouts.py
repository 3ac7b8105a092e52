"""What makes a checkpoint causal, and the sampling rule (:class:`~fastwan.checkpoint.causal.CausalRecipe`) each
published kind of causal Wan checkpoint samples with.

* FastVideo's Diffusers layout: ``model_index.json`` ``"_class_name": "WanCausalDMDPipeline"`` with a
  ``"CausalWanTransformer3DModel"`` DiT (diffusers' tensor names; FastVideo saves them so). Its causal settings sit in
  ``transformer/config.json`` (:data:`FASTVIDEO_DIT_DEFAULTS`), the rest in FastVideo's pipeline config for that
  class (:data:`FASTVIDEO_RECIPE`).
* Self-Forcing's and CausVid's released generators (the original Wan names; :mod:`fastwan.checkpoint.causal_files`):
  their family's inference config (:data:`FAMILY_RECIPES`), the files themselves carry none.

Every causal kind here samples Wan2.1 text-to-video with one DiT and no CFG; the generation defaults of a causal
checkpoint are its kind's with that (:func:`causal_preset`).
"""
from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from fastwan.checkpoint.causal import CausalRecipe
from fastwan.checkpoint.presets import PUBLISHED_MIN_WIDTH, Preset
from fastwan.errors import CheckpointError, InvalidArgument
from fastwan.values import json_text

CAUSAL_DMD_PIPELINE = "WanCausalDMDPipeline"  # FastVideo's few-step causal pipeline (SFWan2.1-T2V-1.3B-Diffusers)
# FastVideo's causal pipeline with a full multi-step UniPC schedule per chunk (wan_causal_pipeline.py): recognised,
# not run (a CausalRecipe holds a few-step rule)
CAUSAL_MULTISTEP_PIPELINE = "WanCausalPipeline"
CAUSAL_DIT_CLASS = "CausalWanTransformer3DModel"  # FastVideo's causal DiT (fastvideo/models/dits/causal_wanvideo.py)

# Self-Forcing (guandeh17/Self-Forcing): configs/self_forcing_dmd.yaml sets denoising_step_list 1000/750/500/250,
# warp_denoising_step true, num_frame_per_block 3 and the scheduler's timestep_shift 5.0 (model_kwargs);
# configs/default_config.yaml context_noise 0; utils/wan_wrapper.py builds the DiT with local_attn_size -1 and
# sink_size 0 (every earlier frame, no sinks), which the config leaves so.
# CausVid (tianweiy/CausVid): configs/wan_causal_dmd.yaml (the config its README runs the autoregressive checkpoint
# with) sets denoising_step_list 1000/757/522/0 (causal_inference.py drops the final 0), warp_denoising_step false,
# num_frame_per_block 3; causvid/models/wan/wan_wrapper.py's scheduler has shift 8.0; the clean chunk is run again
# at timestep 0 (causal_inference.py, ``timestep * 0``); its DiT attends to every earlier frame.
FAMILY_RECIPES = MappingProxyType({
    "self-forcing": CausalRecipe(frames_per_chunk=3, timesteps=(1000.0, 750.0, 500.0, 250.0), warp=True, shift=5.0,
                                 context_noise=0.0),
    "causvid": CausalRecipe(frames_per_chunk=3, timesteps=(1000.0, 757.0, 522.0), warp=False, shift=8.0,
                            context_noise=0.0),
})
# FastVideo's pipeline config for WanCausalDMDPipeline (fastvideo/configs/pipelines/wan.py,
# SelfForcingWanT2V480PConfig: flow_shift 5.0, dmd_denoising_steps 1000/750/500/250, warp_denoising_step true;
# context_noise unset: causal_denoising.py reads 0)
FASTVIDEO_RECIPE = MappingProxyType(dict(timesteps=(1000.0, 750.0, 500.0, 250.0), warp=True, shift=5.0,
                                         context_noise=0.0))
# The causal keys of FastVideo's transformer/config.json and their defaults (fastvideo/configs/models/dits/
# wanvideo.py, WanVideoArchConfig): frames per chunk; the self-attention's window in latent frames (-1: every earlier
# frame), its first sink_size frames kept; the KV cache's length without a window; how RoPE positions run over a
# rolled cache
FASTVIDEO_DIT_DEFAULTS = MappingProxyType({"num_frames_per_block": 3, "local_attn_size": -1, "sink_size": 0,
                                           "sliding_window_num_frames": 21, "rope_cache_policy": "absolute"})
ROPE_POLICIES = ("absolute", "relativistic")
CAUSAL_SIZES = MappingProxyType(dict(height=480, width=832, num_frames=81, fps=16))  # Self-Forcing's 21 latent frames
TINY_CAUSAL_FRAMES = 21  # a tiny causal checkpoint's default: 6 latent frames, two chunks of 3


def _int_value(raw: dict, key: str, source: str, low: int, text: str) -> int:
    value = raw.get(key, FASTVIDEO_DIT_DEFAULTS[key])
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CheckpointError(f"{source}: \"{key}\": {json_text(value)} is invalid; it must be {text} (FastVideo's "
                              f"default: {FASTVIDEO_DIT_DEFAULTS[key]}). Fix config.json or download the checkpoint "
                              "again.")
    return value


def fastvideo_recipe(raw: dict, source: str) -> CausalRecipe:
    """The sampling rule of FastVideo's causal DiT whose ``transformer/config.json`` is ``raw`` (read from
    ``source``): its frames per chunk, window and sinks (:data:`FASTVIDEO_DIT_DEFAULTS` where unset) with
    :data:`FASTVIDEO_RECIPE`'s steps. Rules: each causal key holds a valid value; a relativistic RoPE policy is
    refused where it changes anything (a window with sinks)."""
    per_chunk = _int_value(raw, "num_frames_per_block", source, 1, "a whole number >= 1 (latent frames per chunk)")
    local = _int_value(raw, "local_attn_size", source, -1, "-1 (every earlier frame) or a whole number of latent "
                                                           "frames >= 1")
    if local == 0:
        raise CheckpointError(f"{source}: \"local_attn_size\": 0 is invalid; it must be -1 (every earlier frame) or "
                              "a window of >= 1 latent frames. Fix config.json or download the checkpoint again.")
    sinks = _int_value(raw, "sink_size", source, 0, "a whole number >= 0 (latent frames kept at the window's start)")
    context = _int_value(raw, "sliding_window_num_frames", source, 1,
                         "a whole number >= 1 (latent frames the KV cache holds)")
    policy = raw.get("rope_cache_policy", FASTVIDEO_DIT_DEFAULTS["rope_cache_policy"])
    if policy not in ROPE_POLICIES:
        raise CheckpointError(f"{source}: \"rope_cache_policy\": {json_text(policy)} is invalid; it must be one of "
                              f"{', '.join(map(json_text, ROPE_POLICIES))}. Fix config.json or download the checkpoint "
                              "again.")
    if policy == "relativistic" and sinks > 0 and local > 0:
        raise CheckpointError(f"{source}: \"rope_cache_policy\": \"relativistic\" with a window and sinks places "
                              "RoPE positions relative to the window, which fastwan does not run; only the "
                              "\"absolute\" policy is supported.")
    try:
        return CausalRecipe(frames_per_chunk=per_chunk, window_frames=None if local == -1 else local,
                            sink_frames=sinks, context_frames=context, **FASTVIDEO_RECIPE)
    except InvalidArgument as exc:
        raise CheckpointError(f"{source}: \"num_frames_per_block\": {per_chunk}, \"local_attn_size\": {local}, "
                              f"\"sink_size\": {sinks} make no causal sampling rule fastwan runs: {exc}") from None


def check_causal_dit(causal_pipeline: bool, dit_class: object, source: str) -> None:
    """Rule: a causal pipeline (model_index.json ``WanCausalDMDPipeline``) has FastVideo's causal DiT class, and
    only a causal pipeline has it (FastVideo builds the DiT its config names: a causal pipeline's plain DiT would get
    no KV cache)."""
    if causal_pipeline == (dit_class == CAUSAL_DIT_CLASS):
        return
    if causal_pipeline:
        raise CheckpointError(
            f"{source}: \"_class_name\": {json_text(dit_class)}, but model_index.json's \"_class_name\": "
            f"\"{CAUSAL_DMD_PIPELINE}\" is FastVideo's causal pipeline, whose DiT is \"{CAUSAL_DIT_CLASS}\". Fix "
            "config.json or download the checkpoint again.")
    raise CheckpointError(
        f"{source}: \"_class_name\": \"{CAUSAL_DIT_CLASS}\" is a causal Wan DiT (Self-Forcing: frame chunks one "
        f"after another with a KV cache), but model_index.json names no causal pipeline; a causal checkpoint has "
        f"\"_class_name\": \"{CAUSAL_DMD_PIPELINE}\". Fix model_index.json or download the checkpoint again.")


def causal_preset(preset: Preset, recipe: CausalRecipe, inner_dim: int) -> Preset:
    """The generation defaults of a causal checkpoint: ``len(timesteps)`` steps per chunk, no CFG (the published
    causal pipelines run the conditional pass alone) and, for a published width, Self-Forcing's 81 frames of
    480 x 832 at 16 fps (:data:`CAUSAL_SIZES`); a tiny DiT gets :data:`TINY_CAUSAL_FRAMES` frames (whole chunks)."""
    sizes = dict(CAUSAL_SIZES) if inner_dim >= PUBLISHED_MIN_WIDTH else {"num_frames": TINY_CAUSAL_FRAMES}
    return replace(preset, num_inference_steps=len(recipe.timesteps), guidance_scale=1.0, guidance_scale_2=None,
                   **sizes)
