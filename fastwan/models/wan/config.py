"""One dataclass config for the Wan DiT, read from a Diffusers ``transformer/config.json`` and checked.

Each field carries the rule its config.json value must meet (:class:`Rule`, in the field's metadata);
:meth:`WanConfig.from_dict` checks every field present against its rule, then the rules that tie fields
together, and raises :class:`~fastwan.errors.CheckpointError` naming the file, the key, the value, the rule
and the fix. A key that is absent takes the Diffusers default.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from fastwan.errors import CheckpointError
from fastwan.checkpoint.safetensors import read_json
from fastwan.values import json_text

VACE_CLASS_NAME = "WanVACETransformer3DModel"  # the DiT with VACE's control blocks (Wan2.1-VACE, Wan2.2-VACE-Fun)
# FastVideo's causal DiT (Self-Forcing): the parameters of the plain one; the pipeline decides how it samples
CAUSAL_CLASS_NAME = "CausalWanTransformer3DModel"
# Wan2.2-Animate's DiT: pose embedding, motion and face encoders, face adapters (fastwan.models.wan.animate)
ANIMATE_CLASS_NAME = "WanAnimateTransformer3DModel"
WAN_CLASS_NAMES = ("WanTransformer3DModel", VACE_CLASS_NAME, CAUSAL_CLASS_NAME, ANIMATE_CLASS_NAME)
VACE_DEFAULTS = {"vace_layers": (0, 5, 10, 15, 20, 25, 30, 35), "vace_in_channels": 96}  # diffusers' defaults
# diffusers' defaults of the Animate DiT's own keys (latent_channels null: (in_channels - 4) / 2; the channel table
# null: MOTION_CHANNELS), and of the shared keys whose Animate default differs from the plain DiT's
ANIMATE_DEFAULTS = {"latent_channels": None, "motion_encoder_channel_sizes": None, "motion_encoder_size": 512,
                    "motion_style_dim": 512, "motion_dim": 20, "motion_encoder_dim": 512,
                    "face_encoder_hidden_dim": 1024, "face_encoder_num_heads": 4, "inject_face_latents_blocks": 5,
                    "motion_encoder_batch_size": 8}
ANIMATE_SHARED_DEFAULTS = {"in_channels": 36, "image_dim": 1280}
# the motion encoder's channels at each resolution (diffusers' table): resolution -> channels
MOTION_CHANNELS = ((4, 512), (8, 512), (16, 512), (32, 512), (64, 256), (128, 128), (256, 64), (512, 32), (1024, 16))
QK_NORMS = ("rms_norm_across_heads",)


def _is_int(value: object) -> bool:
    """A JSON integer: an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: object) -> bool:
    return _is_int(value) and value > 0


def _positive_even_int(value: object) -> bool:
    return _positive_int(value) and value % 2 == 0


def _patch_size(value: object) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 3 and all(_positive_int(v) for v in value)


def _positive_finite(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _vace_layers(value: object) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0 and value[0] == 0 and all(_is_int(v) for v in value)
            and all(a < b for a, b in zip(value, value[1:])))


def _channel_table(value: object) -> bool:
    return isinstance(value, dict) and len(value) > 0 and all(
        isinstance(k, str) and k.isdigit() and _positive_int(v) for k, v in value.items())


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _qk_norm(value: object) -> bool:
    return isinstance(value, str) and value in QK_NORMS


@dataclass(frozen=True)
class Rule:
    """What a config.json value must be: ``test(value)`` is true for a valid value, ``text`` states the rule.

    ``nullable``: JSON null is valid too (the field is unset).
    """

    test: Callable[[object], bool]
    text: str
    nullable: bool = False

    def accepts(self, value: object) -> bool:
        return (value is None and self.nullable) or self.test(value)


POSITIVE_INT = Rule(_positive_int, "a positive integer (a JSON number without a fraction, not a string or boolean)")
# the sinusoidal time embedding and RoPE both work on channel pairs
EVEN_INT = Rule(_positive_even_int, "a positive even integer (it is split into channel pairs)")
OPTIONAL_INT = Rule(_positive_int, "a positive integer or null", nullable=True)
PATCH = Rule(_patch_size, "a list of 3 positive integers [t, h, w]")
BOOL = Rule(_is_bool, "true or false (a JSON boolean, not a string or number)")
EPS = Rule(_positive_finite, "a finite positive number (a JSON number, not a string)")
VACE_LAYERS = Rule(_vace_layers, "a list of increasing block indices starting at 0 (the blocks that take a VACE "
                   "hint)", nullable=True)
CHANNEL_TABLE = Rule(_channel_table, "an object mapping resolutions (\"4\", \"8\", ...) to positive channel "
                     "counts, or null", nullable=True)
QK_NORM = Rule(_qk_norm, f"one of {', '.join(json_text(n) for n in QK_NORMS)} (the q/k normalisation Wan uses)")


def _field(default: object, rule: Rule):
    """A dataclass field with its default (the Diffusers default) and the rule its value must meet."""
    return field(default=default, metadata={"rule": rule})


@dataclass(frozen=True)
class WanConfig:
    """Hyper-parameters of ``WanTransformer3DModel`` (the Diffusers names and defaults)."""

    patch_size: tuple[int, int, int] = _field((1, 2, 2), PATCH)
    num_attention_heads: int = _field(40, POSITIVE_INT)
    attention_head_dim: int = _field(128, EVEN_INT)
    in_channels: int = _field(16, POSITIVE_INT)
    out_channels: int | None = _field(16, OPTIONAL_INT)  # null: the same as in_channels (as in Diffusers)
    text_dim: int = _field(4096, POSITIVE_INT)
    freq_dim: int = _field(256, EVEN_INT)
    ffn_dim: int = _field(13824, POSITIVE_INT)
    num_layers: int = _field(40, POSITIVE_INT)
    cross_attn_norm: bool = _field(True, BOOL)
    qk_norm: str = _field("rms_norm_across_heads", QK_NORM)
    eps: float = _field(1e-6, EPS)
    image_dim: int | None = _field(None, OPTIONAL_INT)
    added_kv_proj_dim: int | None = _field(None, OPTIONAL_INT)
    rope_max_seq_len: int = _field(1024, POSITIVE_INT)
    pos_embed_seq_len: int | None = _field(None, OPTIONAL_INT)
    # VACE (WanVACETransformer3DModel only; None for the plain DiT): the blocks after which a control hint is added,
    # and the channels of the control latents the VACE patch embedding reads
    vace_layers: tuple[int, ...] | None = _field(None, VACE_LAYERS)
    vace_in_channels: int | None = _field(None, OPTIONAL_INT)
    # Animate (WanAnimateTransformer3DModel only; None for the other DiTs), diffusers' names: the pose latents'
    # channels, the motion encoder (face frames' resolution, its channels per resolution as (resolution, channels)
    # pairs, style / motion / output widths, frames per batch) and the face encoder (width, heads); a face adapter
    # runs after every inject_face_latents_blocks-th block
    latent_channels: int | None = _field(None, OPTIONAL_INT)
    motion_encoder_channel_sizes: tuple[tuple[int, int], ...] | None = _field(None, CHANNEL_TABLE)
    motion_encoder_size: int | None = _field(None, OPTIONAL_INT)
    motion_style_dim: int | None = _field(None, OPTIONAL_INT)
    motion_dim: int | None = _field(None, OPTIONAL_INT)
    motion_encoder_dim: int | None = _field(None, OPTIONAL_INT)
    face_encoder_hidden_dim: int | None = _field(None, OPTIONAL_INT)
    face_encoder_num_heads: int | None = _field(None, OPTIONAL_INT)
    inject_face_latents_blocks: int | None = _field(None, OPTIONAL_INT)
    motion_encoder_batch_size: int | None = _field(None, OPTIONAL_INT)

    @property
    def vace(self) -> bool:
        """Whether the DiT has VACE's control blocks."""
        return self.vace_layers is not None

    @property
    def animate(self) -> bool:
        """Whether the DiT is Wan2.2-Animate's (pose embedding, motion and face encoders, face adapters)."""
        return self.motion_encoder_size is not None

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> WanConfig:
        """The config a Diffusers ``config.json`` (``raw``, read from ``source``) describes, checked first."""
        _check_class_name(raw, source)
        _check_not_quantized(raw, source)
        kwargs = {}
        vace = raw.get("_class_name") == VACE_CLASS_NAME
        animate = raw.get("_class_name") == ANIMATE_CLASS_NAME
        if animate:
            raw = {**ANIMATE_SHARED_DEFAULTS, **ANIMATE_DEFAULTS, **{k: v for k, v in raw.items()
                                                                     if v is not None or k not in ANIMATE_DEFAULTS}}
        for f in fields(cls):
            if (f.name in VACE_DEFAULTS and not vace) or (f.name in ANIMATE_DEFAULTS and not animate):
                continue  # a DiT has another class's modules only in that class, whatever its config says
            if f.name in VACE_DEFAULTS and raw.get(f.name) is None:
                kwargs[f.name] = VACE_DEFAULTS[f.name]
            elif f.name in raw:
                _check_value(source, f.name, raw[f.name], f.metadata["rule"], f.default)
                kwargs[f.name] = raw[f.name]
        for key in ("patch_size", "vace_layers"):
            if kwargs.get(key) is not None:
                kwargs[key] = tuple(kwargs[key])
        if "eps" in kwargs:
            kwargs["eps"] = float(kwargs["eps"])
        if animate:
            _animate_kwargs(kwargs)
        if "out_channels" in kwargs and kwargs["out_channels"] is None:
            kwargs["out_channels"] = kwargs.get("in_channels", cls.in_channels)
        cfg = cls(**kwargs)
        if animate:
            _check_animate(cfg, source)
        _check_image_conditioning(cfg, source)
        if vace and cfg.vace_layers[-1] >= cfg.num_layers:
            raise CheckpointError(
                f"{source}: \"vace_layers\": {json_text(list(cfg.vace_layers))} names block {cfg.vace_layers[-1]}, but "
                f"the DiT has \"num_layers\": {cfg.num_layers} (blocks 0..{cfg.num_layers - 1}). Fix config.json or "
                "download the checkpoint again.")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> WanConfig:
        raw = read_json(path, missing="a Diffusers Wan transformer folder needs config.json.")
        return cls.from_dict(raw, source=str(path))


def _animate_kwargs(kwargs: dict) -> None:
    """An Animate DiT's derived values, as diffusers derives them: latent_channels null -> (in_channels - 4) / 2;
    out_channels null -> latent_channels; the channel table as sorted (resolution, channels) pairs (null:
    :data:`MOTION_CHANNELS`)."""
    if kwargs["latent_channels"] is None:
        kwargs["latent_channels"] = (kwargs["in_channels"] - 4) // 2
    if kwargs.get("out_channels") is None:
        kwargs["out_channels"] = kwargs["latent_channels"]
    table = kwargs["motion_encoder_channel_sizes"]
    kwargs["motion_encoder_channel_sizes"] = (MOTION_CHANNELS if table is None else
                                              tuple(sorted((int(k), v) for k, v in table.items())))


def _check_animate(cfg: WanConfig, source: str) -> None:
    """Rules of an Animate DiT: the latents read are the noise's, the reference's and a 4-channel mask
    (in_channels = 2 x latent_channels + 4); the pose latents are added one latent frame per token frame
    (patch_size[0] = 1); a face adapter follows blocks 0, inject, 2 inject, ... and there are
    num_layers / inject of them (num_layers a multiple of inject); the motion encoder halves the face frames from
    motion_encoder_size (a power of two, at least 4) down to 4, with a channel count at each resolution."""
    size, table = cfg.motion_encoder_size, dict(cfg.motion_encoder_channel_sizes)
    rules = [
        (cfg.in_channels == 2 * cfg.latent_channels + 4, f"\"in_channels\": {cfg.in_channels} must be 2 x "
         f"\"latent_channels\" + 4 = {2 * cfg.latent_channels + 4}"),
        (cfg.patch_size[0] == 1, f"\"patch_size\": {json_text(list(cfg.patch_size))} must have a temporal patch of 1 "
         "(the pose latents add to the token frames one by one)"),
        (cfg.num_layers % cfg.inject_face_latents_blocks == 0, f"\"num_layers\": {cfg.num_layers} must be a multiple "
         f"of \"inject_face_latents_blocks\": {cfg.inject_face_latents_blocks} (one face adapter per group of blocks)"),
        (size >= 4 and size & (size - 1) == 0, f"\"motion_encoder_size\": {size} must be a power of two, at least 4"),
    ]
    missing = [str(r) for r in (2 ** i for i in range(2, size.bit_length())) if r not in table]
    rules.append((not missing, f"\"motion_encoder_channel_sizes\" has no channel count for resolutions "
                               f"{', '.join(missing)} (it needs one for each of 4, 8, ..., {size})"))
    for ok, rule in rules:
        if not ok:
            raise CheckpointError(f"{source}: {rule} in a {ANIMATE_CLASS_NAME}. Fix config.json or download the "
                                  "checkpoint again.")


def _check_class_name(raw: dict, source: str) -> None:
    """Rule: ``_class_name`` names a Wan DiT class (whether the pipeline may hold it is the resolver's rule)."""
    name = raw.get("_class_name")
    if not (isinstance(name, str) and name in WAN_CLASS_NAMES):
        raise CheckpointError(
            f"{source}: \"_class_name\": {json_text(name)} describes a model that is not a Wan DiT (expected "
            f"_class_name in {WAN_CLASS_NAMES}). Point fastwan at a Wan2.1/Wan2.2 checkpoint in the Diffusers "
            "layout."
        )


def _check_not_quantized(raw: dict, source: str) -> None:
    """Rule: no ``quantization_config`` (weights diffusers stored quantized, e.g. bitsandbytes, which fastwan does
    not read; its own FP8 folders say ``fastwan_quantization``)."""
    if "quantization_config" not in raw:
        return
    qc = raw["quantization_config"]
    method = qc.get("quant_method") if isinstance(qc, dict) else qc
    raise CheckpointError(
        f"{source}: \"quantization_config\" (quant_method {json_text(method)}) says the weights were stored "
        "quantized by diffusers, which fastwan does not load. Use the original (unquantized) checkpoint; for "
        "smaller DiT weights pass quantization='fp8' (--quantization fp8).")


def _check_value(source: str, key: str, value: object, rule: Rule, default: object) -> None:
    """Raise a CheckpointError naming the file, key, value, rule and fix unless ``rule`` accepts ``value``."""
    if rule.accepts(value):
        return
    raise CheckpointError(
        f"{source}: \"{key}\": {json_text(value)} is invalid; {key} must be {rule.text}. Fix config.json (the "
        f"Diffusers default is \"{key}\": {json_text(list(default) if isinstance(default, tuple) else default)}) "
        "or download the checkpoint again."
    )


def _check_image_conditioning(cfg: WanConfig, source: str) -> None:
    """Rule for a DiT with image tokens: the image embedder's output (the DiT's width) is what the blocks' added
    key/value projections read, so ``image_dim`` and ``added_kv_proj_dim`` come together, the latter equal to
    the width."""
    if (cfg.image_dim is None) != (cfg.added_kv_proj_dim is None) or \
            cfg.added_kv_proj_dim not in (None, cfg.inner_dim):
        raise CheckpointError(
            f"{source}: \"image_dim\": {json_text(cfg.image_dim)} and \"added_kv_proj_dim\": "
            f"{json_text(cfg.added_kv_proj_dim)} do not fit: an image-conditioned Wan DiT sets both, with "
            f"added_kv_proj_dim equal to num_attention_heads x attention_head_dim = {cfg.inner_dim}; a text-only one "
            "sets neither. Fix config.json or download the checkpoint again.")


def check_text_to_video(cfg: WanConfig, source: str) -> None:
    """Rules for the DiT of a text-to-video pipeline: no image conditioning, and it predicts a latent of the shape
    it reads."""
    if cfg.image_dim is not None or cfg.added_kv_proj_dim is not None:
        raise CheckpointError(
            f"{source} is an image-to-video Wan DiT (\"image_dim\": {json_text(cfg.image_dim)}, "
            f"\"added_kv_proj_dim\": {json_text(cfg.added_kv_proj_dim)}), but model_index.json names a "
            "text-to-video pipeline; an image-to-video checkpoint's model_index.json has \"_class_name\": "
            "\"WanImageToVideoPipeline\". Fix model_index.json, or download the checkpoint again."
        )
    if cfg.out_channels != cfg.in_channels:
        raise CheckpointError(
            f"{source}: \"in_channels\": {cfg.in_channels} and \"out_channels\": {cfg.out_channels} differ; a "
            "text-to-video Wan DiT predicts a latent with the channels it reads (in_channels = 2 x out_channels + "
            "4 is an image-to-video DiT, whose model_index.json has \"_class_name\": \"WanImageToVideoPipeline\"). "
            "Fix the config or model_index.json, or download the checkpoint again."
        )
