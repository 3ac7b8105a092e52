"""Checks of the components a Wan checkpoint loads through diffusers and transformers, made before any weight
loads: each component folder holds its config; the VAE's latent channels and the text encoder's width are the
DiT's; the CLIP encoder fits the DiT; the VAE and the encoders keep their weights under the file names their
loaders read; the scheduler and tokenizer are the classes diffusers' ``DiffusionPipeline.from_pretrained`` builds
(those ``model_index.json`` names), the scheduler with valid settings."""
from __future__ import annotations

import logging
import math
from pathlib import Path

from fastwan.checkpoint.causal_layouts import CAUSAL_DMD_PIPELINE
from fastwan.checkpoint.safetensors import PICKLE_SUFFIXES, file_variant, read_json
from fastwan.errors import CheckpointError, MissingFileError
from fastwan.models.wan.config import WanConfig
from fastwan.values import json_text

logger = logging.getLogger("fastwan")

SHIFT_KEYS = ("flow_shift", "shift")  # a diffusers scheduler's flow shift: UniPC's, FlowMatchEuler's
# FastVideo's scheduler of its causal checkpoints (SFWan2.1-T2V-1.3B-Diffusers: shift 5, 1000 steps, sigma_min 0,
# extra_one_step), a class diffusers does not have: in a causal pipeline it reads as diffusers'
# FlowMatchEulerDiscreteScheduler at its shift (a causal checkpoint samples by its CausalRecipe, whose warp is that
# schedule)
SELF_FORCING_SCHEDULER = "SelfForcingFlowMatchScheduler"

# the configuration file (a JSON object) of each component loaded by diffusers / transformers; the DiTs' configs
# and the scheduler's are read by their own checks
COMPONENT_CONFIGS = {"text_encoder": "config.json", "vae": "config.json", "image_encoder": "config.json",
                     "image_processor": "preprocessor_config.json"}
TOKENIZER_FILES = ("tokenizer.json", "spiece.model")  # UMT5's tokenizer: the fast one or its SentencePiece model
# the weight file names each loader reads (before the variant and the suffix): diffusers' models, transformers'
LOADER_NAMES = {"vae": ("diffusers' AutoencoderKLWan", "diffusion_pytorch_model", "diffusion_pytorch_model"),
                "text_encoder": ("transformers' UMT5EncoderModel", "model", "pytorch_model"),
                "image_encoder": ("transformers' CLIPVisionModel", "model", "pytorch_model")}


def check_components(root: Path, index_path: Path, needed: tuple[str, ...]) -> None:
    """Every component folder in ``needed`` exists, holding its config (a JSON object) and, for the tokenizer,
    tokenizer.json or spiece.model."""
    for comp in needed:
        if not (root / comp).is_dir():
            raise MissingFileError(
                f"checkpoint {root} is missing its '{comp}/' component; this Wan checkpoint (per {index_path.name}) "
                f"needs {', '.join(needed)}. Download the checkpoint again."
            )
        if comp in COMPONENT_CONFIGS:
            read_json(root / comp / COMPONENT_CONFIGS[comp], missing=f"the {comp} component needs it; download "
                      "the checkpoint again.")
    if not any((root / "tokenizer" / f).is_file() for f in TOKENIZER_FILES):
        raise MissingFileError(
            f"{root / 'tokenizer'} holds neither {' nor '.join(TOKENIZER_FILES)}; the UMT5 tokenizer needs one of "
            "them. Download the checkpoint again."
        )


def check_latent_channels(root: Path, cfg: WanConfig) -> None:
    """Rule: the VAE's ``z_dim`` (diffusers' default 16 when absent) is the DiT's ``out_channels``, and its
    ``latents_mean`` / ``latents_std``, when given, hold one number per latent channel."""
    import inspect

    import diffusers

    path = root / "vae" / "config.json"
    vae = read_json(path, missing="the vae component needs it.")
    z_dim = vae.get("z_dim", inspect.signature(diffusers.AutoencoderKLWan.__init__).parameters["z_dim"].default)
    if z_dim != cfg.out_channels:
        raise CheckpointError(
            f"{path}: \"z_dim\": {json_text(z_dim)}, but the DiT predicts {cfg.out_channels}-channel latents "
            f"(transformer/config.json \"out_channels\"); the VAE decodes what the DiT predicts, so the two must be "
            "equal (16 for Wan2.1 and Wan2.2-A14B, 48 for Wan2.2-TI2V-5B). Use the VAE of the same checkpoint.")
    for key in ("latents_mean", "latents_std"):
        value = vae.get(key)
        if value is not None and not (isinstance(value, list) and len(value) == z_dim):
            raise CheckpointError(
                f"{path}: \"{key}\" must list one number per latent channel ({z_dim}), got {json_text(value)[:80]}. "
                "Download the checkpoint again.")


def check_text_width(root: Path, cfg: WanConfig) -> None:
    """Rule: the text encoder's width ``d_model`` (transformers' UMT5 default when absent) is the DiT's
    ``text_dim``: the DiT embeds the encoder's hidden states."""
    from transformers import UMT5Config

    path = root / "text_encoder" / "config.json"
    width = read_json(path, missing="the text_encoder component needs it.").get("d_model", UMT5Config().d_model)
    if width != cfg.text_dim:
        raise CheckpointError(
            f"{path}: \"d_model\": {json_text(width)}, but the DiT's \"text_dim\" is {cfg.text_dim}; the DiT embeds "
            "the text encoder's hidden states, so the two must be equal (4096, UMT5-XXL, for every Wan model). "
            "Use the text encoder of the same checkpoint.")


def check_clip(clip: dict, cfg: WanConfig, path: Path) -> None:
    """Rules for the CLIP vision encoder beside the DiT: its width is the DiT's ``image_dim``, and an FLF2V DiT's
    ``pos_embed_seq_len`` holds the tokens of two images (one per patch, plus the class token)."""
    from transformers import CLIPVisionConfig

    vision = clip.get("vision_config", clip)  # a whole CLIPModel's config nests the vision tower's
    defaults = CLIPVisionConfig()  # what transformers reads for a key the file leaves out
    width, size, patch = (vision.get(k, getattr(defaults, k)) for k in ("hidden_size", "image_size", "patch_size"))
    if width != cfg.image_dim:
        raise CheckpointError(
            f"{path}: \"hidden_size\": {json_text(width)}, but the DiT's \"image_dim\" is {cfg.image_dim}; the CLIP "
            "image encoder's hidden states enter the DiT's image embedder, so the two must be equal. Download the "
            "checkpoint again.")
    if cfg.pos_embed_seq_len is None:
        return
    if not (type(size) is int and type(patch) is int and 0 < patch <= size):
        raise CheckpointError(f"{path}: \"image_size\": {json_text(size)}, \"patch_size\": {json_text(patch)} must be "
                              "positive ints (patch_size <= image_size). Download the checkpoint again.")
    tokens = (size // patch) ** 2 + 1
    if cfg.pos_embed_seq_len != 2 * tokens:
        raise CheckpointError(
            f"{path}: a CLIP of image_size {size} and patch_size {patch} gives {tokens} tokens per image, but the "
            f"DiT's \"pos_embed_seq_len\" is {cfg.pos_embed_seq_len}, not 2 x {tokens} (first and last frame). "
            "Download the checkpoint again.")


def check_loader_files(folder: Path, component: str, files: list[Path]) -> None:
    """Rule: the weights ``files`` chosen for ``component`` (vae, text_encoder, image_encoder) sit under the name
    its loader opens: ``<name>[.variant].safetensors`` or the shard index ``<name>.safetensors.index[.variant].json``
    (pickle files: ``<pickle name>[.variant].bin`` or its ``.bin.index`` json), names as in ``LOADER_NAMES``."""
    loader, name, pickle_name = LOADER_NAMES[component]
    pickled = files[0].suffix in PICKLE_SUFFIXES
    variant = file_variant(files[0].name)
    tag = f".{variant}" if variant else ""
    base, suffix = (pickle_name, ".bin") if pickled else (name, ".safetensors")
    wanted = (f"{base}{tag}{suffix}", f"{base}{suffix}.index{tag}.json")
    if any((folder / w).is_file() for w in wanted):
        return
    raise CheckpointError(
        f"{folder} keeps its weights as {', '.join(f.name for f in files[:3])}, but {loader} reads "
        f"{wanted[0]} (or the shard index {wanted[1]}); rename the file, or download the checkpoint again.")


def _index_class(index: dict, component: str) -> str | None:
    """The class ``model_index.json`` names for ``component`` ([library, class]), or None."""
    entry = index.get(component)
    if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str) and entry[1]:
        return entry[1]
    return None


def scheduler_class(index: dict, root: Path, *, warn: bool = False):
    """The diffusers scheduler class of the checkpoint, with its config checked -> (class, config). Rule, as
    diffusers' pipeline loading builds it: the class ``model_index.json`` names for the scheduler, else the config's
    ``_class_name``; it must be a diffusers scheduler, and the shifts of ``SHIFT_KEYS`` positive finite
    numbers. ``warn``: log when the config names another class (its choice is not the one that runs)."""
    import diffusers

    path = root / "scheduler" / "scheduler_config.json"
    cfg = read_json(path, missing="the scheduler component needs it.")
    own, named = cfg.get("_class_name"), _index_class(index, "scheduler")
    if warn and named is not None and own is not None and own != named:
        logger.warning("%s names the scheduler class %s, but %s names %s: the scheduler is a %s, as diffusers "
                       "builds it; set the class you want in both files", path, json_text(own),
                       root / "model_index.json", named, named)
    name = named or own
    if name == SELF_FORCING_SCHEDULER and index.get("_class_name") == CAUSAL_DMD_PIPELINE:
        name, cfg = "FlowMatchEulerDiscreteScheduler", {"num_train_timesteps": cfg.get("num_train_timesteps", 1000),
                                                        "shift": cfg.get("shift", 3.0)}
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.SchedulerMixin)):
        raise CheckpointError(
            f"{root / 'model_index.json' if named else path}: the scheduler class {json_text(name)} is not "
            "a diffusers scheduler class; Wan checkpoints use \"UniPCMultistepScheduler\" or "
            "\"FlowMatchEulerDiscreteScheduler\". Fix the file or download the checkpoint again.")
    for key in SHIFT_KEYS:
        value = cfg.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and not (number and math.isfinite(value) and value > 0):
            raise CheckpointError(
                f"{path}: \"{key}\": {json_text(value)} must be a positive number (the flow-matching shift; Wan "
                "uses 3.0 at 480p and 5.0 at 720p). Fix the file or download the checkpoint again.")
    return cls, cfg


def tokenizer_class(index: dict):
    """The transformers tokenizer class ``model_index.json`` names (as diffusers builds it), else
    ``AutoTokenizer`` (which reads the class from ``tokenizer_config.json``)."""
    import transformers

    cls = getattr(transformers, _index_class(index, "tokenizer") or "", None)
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
        return cls
    return transformers.AutoTokenizer
