"""Resolve a model argument (Hub id, local folder, ``tiny``) to a checked Diffusers-format Wan checkpoint."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from fastwan.checkpoint.components import (
    check_clip,
    check_components,
    check_latent_channels,
    check_loader_files,
    check_text_width,
    scheduler_class,
)
from fastwan.checkpoint.causal import CausalRecipe
from fastwan.checkpoint.causal_layouts import (
    CAUSAL_DMD_PIPELINE,
    CAUSAL_MULTISTEP_PIPELINE,
    causal_preset,
    check_causal_dit,
    fastvideo_recipe,
)
from fastwan.checkpoint.hub import download, fetch_components
from fastwan.checkpoint.presets import IMAGE_VARIANTS, Preset, checkpoint_preset
from fastwan.checkpoint.safetensors import (
    HUB_COMMIT,
    HUB_MODEL_ID,
    read_json,
    weight_files,
    weight_variant,
)
from fastwan.checkpoint.tiny import TINY_IDS, tiny_checkpoint
from fastwan.errors import CheckpointError, InvalidArgument, InvalidArgumentType, MissingFileError
from fastwan.models.wan.config import WanConfig, check_text_to_video
from fastwan.models.wan.loading import check_transformer_files
from fastwan.values import json_text

REQUIRED = ("transformer", "text_encoder", "tokenizer", "vae", "scheduler")
T2V_PIPELINE = "WanPipeline"  # the Diffusers text-to-video class (Wan2.1-T2V, Wan2.2-T2V-A14B, Wan2.2-TI2V-5B)
DMD_PIPELINE = "WanDMDPipeline"  # FastVideo's DMD-distilled text-to-video (FastWan): the Wan layout, DMD sampling
I2V_PIPELINE = "WanImageToVideoPipeline"  # Wan2.1-I2V, Wan2.1-FLF2V, Wan2.2-I2V-A14B
# FastVideo's DMD-distilled image-to-video (fastvideo/pipelines/basic/wan/wan_i2v_dmd_pipeline.py, class spelled
# so): the image-to-video layout, DMD sampling
I2V_DMD_PIPELINE = "WanImageToVideoDmdPipeline"
VACE_PIPELINE = "WanVACEPipeline"  # Wan2.1-VACE, Wan2.2-VACE-Fun-A14B: a WanVACETransformer3DModel DiT
ANIMATE_PIPELINE = "WanAnimatePipeline"  # Wan2.2-Animate-14B: a WanAnimateTransformer3DModel DiT and a CLIP
# FastVideo's causal few-step text-to-video (Self-Forcing, SFWan2.1-T2V-1.3B-Diffusers): :mod:`.causal_layouts`
PIPELINES = (T2V_PIPELINE, DMD_PIPELINE, I2V_PIPELINE, I2V_DMD_PIPELINE, VACE_PIPELINE, CAUSAL_DMD_PIPELINE,
             ANIMATE_PIPELINE)
IMAGE_COMPONENTS = ("image_encoder", "image_processor")  # the CLIP of Wan2.1 I2V / FLF2V
TRANSFORMERS_LOADED = ("text_encoder", "image_encoder")  # the weight folders transformers' from_pretrained reads
# the task of a Wan pipeline class fastwan does not run, by a word in its name
OTHER_TASKS = (("VideoToVideo", "video-to-video"),
               # FastVideo's WanCausalPipeline: a causal DiT sampled with a full UniPC schedule per chunk
               ("Causal", f"causal multi-step generation ({CAUSAL_MULTISTEP_PIPELINE}: a full UniPC schedule per "
                          "chunk)"))


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    variant: str  # a key of TINY_PRESETS (the model kinds)
    preset: Preset
    index: dict
    transformer_config: WanConfig
    experts: tuple[str, ...]  # ("transformer",) or ("transformer", "transformer_2")
    boundary_ratio: float | None
    expand_timesteps: bool
    image_encoder: bool = False  # a CLIP image encoder (image_encoder/, image_processor/) to load
    distilled: bool = False  # DMD-distilled (FastWan, WanImageToVideoDmdPipeline): the preset samples with "dmd"
    vsa_gates: bool = False  # the DiT was trained with VSA (it carries to_gate_compress gates)
    # the diffusers ``variant`` of each component's weight files (None: the plain files); from_pretrained passes
    # it to diffusers / transformers
    variants: dict = dataclasses.field(default_factory=dict)
    image_to_video: bool = False  # an image-to-video pipeline class (model_index.json), whatever the DiT's kind
    # a causal checkpoint's sampling rule (FastVideo's WanCausalDMDPipeline, or a Self-Forcing / CausVid generator
    # file loaded over a base checkpoint: fastwan.checkpoint.causal_files); None: the DiT samples the whole video
    causal: CausalRecipe | None = None
    # the DiT's tensors from a file other than transformer/ (a causal generator file: keys() / items() by the DiT's
    # names, fastwan.checkpoint.causal_files.GeneratorWeights); None: the folder's
    dit_weights: object | None = None

    @property
    def needs_image(self) -> bool:
        """Image-to-video checkpoints generate from an image only: the image-to-video kinds of DiT, and any DiT
        of an image-to-video pipeline class (a TI2V-5B saved by WanImageToVideoPipeline)."""
        return self.variant in IMAGE_VARIANTS or self.image_to_video

    def folder(self, component: str) -> Path:
        return self.root / component


@dataclass(frozen=True)
class PipelineIndex:
    """What fastwan reads from ``model_index.json``, checked."""

    experts: tuple[str, ...]
    boundary_ratio: float | None
    expand_timesteps: bool
    image_to_video: bool = False
    image_encoder: bool = False
    distilled: bool = False
    causal: bool = False  # FastVideo's WanCausalDMDPipeline
    animate: bool = False  # Wan2.2-Animate's WanAnimatePipeline (an image-to-video layout with a CLIP)


def _locate(name: str, revision: str | None = None) -> tuple[Path, str | None, bool]:
    """(folder, tiny variant or None, whether it is a Hub snapshot holding only model_index.json so far)."""
    tiny_variant = TINY_IDS.get(name)
    if tiny_variant is not None:
        return tiny_checkpoint(tiny_variant), tiny_variant, False
    if Path(name).expanduser().exists():
        root = Path(name).expanduser()
        if not root.is_dir():
            raise MissingFileError(
                f"model {name!r} is a file; pass the checkpoint folder (the one holding model_index.json)."
            )
        return root, None, False
    if HUB_MODEL_ID.match(name) and not name.startswith((".", "/", "~")):
        return download(name, ["model_index.json"], revision), None, True
    raise MissingFileError(
        f"model {name!r} is not a folder that exists, not a Hub id (owner/name), and not one of "
        f"{', '.join(TINY_IDS)}. Check the path or the model id."
    )


ORIGINAL_WAN_FILES = ("Wan2.1_VAE.pth", "Wan2.2_VAE.pth", "models_t5_umt5-xxl-enc-bf16.pth")


def _not_a_pipeline(root: Path, name: str, hub: bool) -> str:
    """Why a folder without model_index.json cannot load, and what to pass instead (for the missing-file error)."""
    where = f"the Hub repository {name!r}" if hub else str(root)
    diffusers_id = f"{name}-Diffusers" if hub and not name.endswith("-Diffusers") else None
    config = root / "config.json"
    cls = None
    if config.is_file():
        try:
            cls = json.loads(config.read_text()).get("_class_name")
        except (ValueError, UnicodeDecodeError, AttributeError):
            cls = None
    if cls == "WanModel" or any((root / f).exists() for f in ORIGINAL_WAN_FILES):
        return (f"{where} is in the original Wan release layout, not the Diffusers layout; fastwan loads the "
                "Diffusers-format repository of the same weights" + (
                    f" ({diffusers_id!r})." if diffusers_id else
                    f" (Wan-AI/{root.name}-Diffusers for Wan-AI/{root.name})." if root.name.startswith("Wan") else
                    ", e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers for Wan-AI/Wan2.1-T2V-1.3B."))
    if isinstance(cls, str) and (root.parent / "model_index.json").is_file():
        return (f"{where} is the {root.name!r} component ({cls}) of a pipeline; pass the pipeline folder "
                f"{str(root.parent)!r}, which holds model_index.json.")
    return (f"{where} is not a Diffusers-format pipeline folder; pass the folder holding model_index.json"
            f"{f' (a Diffusers repository such as {diffusers_id!r})' if diffusers_id else ''}.")


def _check_pipeline_class(index: dict, path: Path) -> None:
    """Rule: ``_class_name`` is one of :data:`PIPELINES` (the Wan text-to-video or image-to-video pipeline classes,
    diffusers' or FastVideo's DMD ones, spelled exactly: diffusers and FastVideo look them up so)."""
    cls = index.get("_class_name")
    if cls in PIPELINES:
        return
    names = ", ".join(f'"{c}"' for c in PIPELINES)
    known = next((c for c in PIPELINES if isinstance(cls, str) and cls.lower() == c.lower()), None)
    if known is not None:
        raise CheckpointError(
            f"{path}: \"_class_name\": {json_text(cls)} is not a pipeline class; diffusers and FastVideo find the "
            f"class by its exact name, \"{known}\". Fix model_index.json or download the checkpoint again.")
    if not (isinstance(cls, str) and cls.startswith("Wan")):
        raise CheckpointError(
            f"{path}: \"_class_name\": {json_text(cls)} describes a pipeline that is not a Wan pipeline; fastwan runs "
            f"Wan checkpoints whose model_index.json has \"_class_name\" {names}. "
            "Point fastwan at a Wan2.1/Wan2.2 checkpoint in the Diffusers layout."
        )
    task = next((t for word, t in OTHER_TASKS if word in cls), "this pipeline's task")
    raise CheckpointError(
        f"{path}: \"_class_name\": {json_text(cls)} is a Wan pipeline for another task; fastwan runs text-to-video "
        f"(\"{T2V_PIPELINE}\", \"{DMD_PIPELINE}\") and image-to-video (\"{I2V_PIPELINE}\", \"{I2V_DMD_PIPELINE}\") "
        f"and VACE (\"{VACE_PIPELINE}\"), causal (\"{CAUSAL_DMD_PIPELINE}\") and Wan2.2-Animate "
        f"(\"{ANIMATE_PIPELINE}\") checkpoints, and {task} is not "
        "supported yet. Use one of those."
    )


def _index_experts(index: dict, path: Path) -> tuple[str, ...]:
    """The DiT experts: rule: ``transformer_2`` is absent, null or [null, null] (one expert), or a
    [library, class] pair of non-empty strings (a second expert in ``transformer_2/``)."""
    entry = index.get("transformer_2")
    if entry is None or entry == [None, None]:
        return ("transformer",)
    if isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) and x for x in entry):
        return ("transformer", "transformer_2")
    raise CheckpointError(
        f"{path}: \"transformer_2\": {json_text(entry)} is invalid; it must be [null, null] (one DiT) or a "
        "[library, class] pair such as [\"diffusers\", \"WanTransformer3DModel\"] (a second expert in "
        "transformer_2/). Fix model_index.json or download the checkpoint again."
    )


def _index_boundary(index: dict, path: Path, experts: tuple[str, ...]) -> float | None:
    """Rule: ``boundary_ratio`` is a number in (0, 1) exactly when there are two experts (null otherwise)."""
    value = index.get("boundary_ratio")
    two = len(experts) == 2
    if value is None:
        if two:
            raise CheckpointError(
                f"{path}: \"boundary_ratio\": null (or absent) with two experts; it cannot tell when to switch "
                "from the high-noise to the low-noise expert. Set it (Wan2.2-T2V-A14B uses 0.875) or download "
                "the checkpoint again."
            )
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and 0 < value < 1):
        raise CheckpointError(
            f"{path}: \"boundary_ratio\": {json_text(value)} is invalid; it must be a number in (0, 1) (the fraction "
            "of the training timesteps above which the high-noise expert runs; Wan2.2-T2V-A14B uses 0.875). Fix "
            "model_index.json or download the checkpoint again."
        )
    if not two:
        raise CheckpointError(
            f"{path}: \"boundary_ratio\": {json_text(value)} is set, but \"transformer_2\" names no second expert; "
            "the ratio switches between two experts. Set \"boundary_ratio\": null for a one-DiT checkpoint, or "
            "download the checkpoint again."
        )
    return float(value)


def _index_expand(index: dict, path: Path) -> bool:
    """Rule: ``expand_timesteps`` is true or false (absent or null: false)."""
    value = index.get("expand_timesteps")
    if value is None or isinstance(value, bool):
        return bool(value)
    raise CheckpointError(
        f"{path}: \"expand_timesteps\": {json_text(value)} is invalid; it must be true or false (a JSON boolean; "
        "Wan2.2-TI2V-5B uses true). Fix model_index.json or download the checkpoint again."
    )


def _index_image_encoder(index: dict, path: Path) -> bool:
    """Rule: ``image_encoder`` and ``image_processor`` are both [library, class] pairs (a CLIP to load) or both
    absent / [null, null]."""
    named = []
    for comp in IMAGE_COMPONENTS:
        entry = index.get(comp)
        if entry is None or entry == [None, None]:
            named.append(False)
        elif isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) and x for x in entry):
            named.append(True)
        else:
            raise CheckpointError(
                f"{path}: \"{comp}\": {json_text(entry)} is invalid; it must be [null, null] or a [library, class] "
                "pair such as [\"transformers\", \"CLIPVisionModel\"]. Fix model_index.json or download the "
                "checkpoint again.")
    if named[0] != named[1]:
        enc, proc = (json_text(index.get(c)) for c in IMAGE_COMPONENTS)
        raise CheckpointError(
            f"{path}: \"image_encoder\": {enc} and \"image_processor\": {proc}; the two must be named together "
            "(the CLIP encoder and its preprocessing) or both be null. Fix model_index.json or download the "
            "checkpoint again.")
    return named[0]


def read_pipeline_index(index: dict, path: Path) -> PipelineIndex:
    """The checked meaning of a ``model_index.json`` (``index``, read from ``path``)."""
    _check_pipeline_class(index, path)
    experts = _index_experts(index, path)
    cls = index.get("_class_name")
    animate = cls == ANIMATE_PIPELINE
    i2v = cls in (I2V_PIPELINE, I2V_DMD_PIPELINE, ANIMATE_PIPELINE)  # Animate: noise + mask + condition, CLIP
    causal = cls == CAUSAL_DMD_PIPELINE
    if causal and len(experts) == 2:
        raise CheckpointError(
            f"{path}: \"_class_name\": \"{cls}\" with two experts (\"transformer_2\"): FastVideo's causal Wan2.2 "
            "A14B pipelines (a first chunk of one frame, the experts switching per step) are not supported; causal "
            "checkpoints run with one DiT (SFWan2.1-T2V-1.3B).")
    return PipelineIndex(experts, _index_boundary(index, path, experts), _index_expand(index, path), i2v,
                         i2v and _index_image_encoder(index, path), cls in (DMD_PIPELINE, I2V_DMD_PIPELINE), causal,
                         animate)


def pipeline_index(model: str, revision: str | None = None) -> PipelineIndex:
    """The checked ``model_index.json`` of ``model`` (a folder, a tiny id, or a Hub id, of which only that file is
    fetched): what a check needs before the components download, such as how many DiTs the pipeline has."""
    root, _, hub = _locate(model, revision)
    return _read_index(root, model, hub)[1]


def _read_index(root: Path, name: str, hub: bool) -> tuple[dict, PipelineIndex]:
    """``root``'s ``model_index.json`` and its checked meaning; a folder without one is explained
    (:func:`_not_a_pipeline`)."""
    path = root / "model_index.json"
    index = read_json(path, missing="" if path.is_file() else _not_a_pipeline(root, name, hub))
    return index, read_pipeline_index(index, path)


def _check_image_to_video(cfg: WanConfig, source: str, clip: bool, expand: bool) -> None:
    """Rules for the DiT of an image-to-video pipeline: it reads the noise, a 4-channel frame mask and the
    condition latents (in = 2 x out + 4), and CLIP image tokens exactly when the pipeline has a CLIP encoder.
    With ``expand_timesteps`` (Wan2.2-TI2V-5B saved by diffusers' WanImageToVideoPipeline) the image's latents
    replace the first latent frame instead: the DiT reads the latents alone (in = out), as a text-to-video one."""
    if expand and cfg.in_channels != cfg.out_channels:
        raise CheckpointError(
            f"{source}: \"in_channels\": {cfg.in_channels} with \"out_channels\": {cfg.out_channels}; with "
            "\"expand_timesteps\": true (model_index.json) the image's latents become the first latent frame, so the "
            "DiT reads the latents alone (in_channels = out_channels, Wan2.2-TI2V-5B: 48). Fix the config or "
            "model_index.json, or download the checkpoint again.")
    if not expand and cfg.in_channels != 2 * cfg.out_channels + 4:
        raise CheckpointError(
            f"{source}: \"in_channels\": {cfg.in_channels} with \"out_channels\": {cfg.out_channels}; an "
            "image-to-video Wan DiT reads the noise, the 4-channel frame mask and the condition latents "
            f"(in_channels = 2 x out_channels + 4 = {2 * cfg.out_channels + 4}). Download the checkpoint again.")
    if (cfg.image_dim is not None) != clip:
        raise CheckpointError(
            f"{source}: \"image_dim\": {json_text(cfg.image_dim)}, but the pipeline "
            f"{'has' if clip else 'has no'} CLIP image encoder; a Wan DiT reads image tokens exactly when its "
            "pipeline has one (Wan2.1 I2V / FLF2V). Download the checkpoint again.")


def _expert_configs(root: Path, meta: PipelineIndex) -> list[WanConfig]:
    """The experts' checked configs; rule: two experts share one architecture."""
    experts = meta.experts
    configs = [WanConfig.from_file(root / e / "config.json") for e in experts]
    for e, cfg in zip(experts, configs):
        _check_animate(meta.animate, cfg, root / e / "config.json")
        if meta.image_to_video:
            _check_image_to_video(cfg, str(root / e / "config.json"), meta.image_encoder, meta.expand_timesteps)
        else:
            check_text_to_video(cfg, str(root / e / "config.json"))
    if len(configs) == 2 and configs[0] != configs[1]:
        a, b = (dataclasses.asdict(c) for c in configs)
        diff = [f"{k}: {a[k]!r} vs {b[k]!r}" for k in a if a[k] != b[k]]
        raise CheckpointError(
            f"{root / 'transformer' / 'config.json'} and {root / 'transformer_2' / 'config.json'} describe different "
            f"DiTs ({'; '.join(diff)}); the two experts of a Wan2.2 checkpoint share one architecture. Download "
            "the checkpoint again."
        )
    return configs


def _check_vace(pipeline: bool, cfg: WanConfig, source: Path) -> None:
    """Rule: a VACE pipeline (model_index.json) has VACE DiTs, and only a VACE pipeline has them."""
    if pipeline != cfg.vace:
        raise CheckpointError(
            f"{source} describes a {'plain' if pipeline else 'VACE'} Wan DiT, but model_index.json names "
            f"{'' if pipeline else 'no '}VACE pipeline; a VACE checkpoint has \"_class_name\": \"{VACE_PIPELINE}\" "
            "with a \"WanVACETransformer3DModel\" DiT. Fix model_index.json or download the checkpoint again.")


def _check_animate(pipeline: bool, cfg: WanConfig, source: Path) -> None:
    """Rule: Wan2.2-Animate's pipeline (model_index.json) has an Animate DiT (``WanAnimateTransformer3DModel``: it
    reads pose latents and a face video with every step, which only that pipeline gives it), and only it has one."""
    if pipeline != cfg.animate:
        raise CheckpointError(
            f"{source} describes a {'plain' if pipeline else 'Wan2.2-Animate'} Wan DiT, but model_index.json names "
            f"{'a' if pipeline else 'no'} Wan2.2-Animate pipeline; an Animate checkpoint has \"_class_name\": "
            f"\"{ANIMATE_PIPELINE}\" with a \"WanAnimateTransformer3DModel\" DiT. Fix model_index.json or download "
            "the checkpoint again.")


def checkpoint_label(name: str, root: Path, hub: bool) -> str:
    """The checkpoint's own name, lower case: a Hub id as given, else its folder's name (not a parent's; for a
    Hub-cache snapshot folder ``models--owner--name/snapshots/<commit>``, the repository's)."""
    folder = Path(os.path.abspath(root))  # the name the user gave, not a symlink's target
    if hub or not (HUB_COMMIT.match(folder.name) and folder.parent.name == "snapshots"):
        return (name if hub else folder.name).lower()
    return folder.parent.parent.name.lower()


def resolve(model: str | Path, *, allow_pickle: bool = False, revision: str | None = None) -> Checkpoint:
    """Check everything that can be checked without loading weights; raise early with a clear message.

    A Hub id is fetched with ``huggingface_hub.snapshot_download`` (the cache only, when offline) at
    ``revision`` (a branch, tag or commit; None: the default branch): model_index.json first, which is checked
    before the components it names are fetched. Every DiT's tensor names and shapes are checked from the
    safetensors headers before any expert loads.
    """
    if not isinstance(model, (str, Path)):
        raise InvalidArgumentType(
            f"model={model!r} must be a Hub id, a folder path or 'tiny', not {type(model).__name__}."
        )
    name = str(model)
    if not name.strip():
        raise InvalidArgument(f"model={name!r} is empty; pass a Hub id such as 'Wan-AI/Wan2.1-T2V-1.3B-Diffusers', "
                              "a Diffusers-format folder (use '.' for the current one) or 'tiny'.")
    if revision is not None and not (isinstance(revision, str) and revision.strip()):
        raise InvalidArgumentType(f"revision={revision!r} must be a non-empty string (a Hub branch, tag or "
                                  "commit) or None.")
    root, tiny_variant, hub = _locate(name, revision)
    if revision is not None and not hub:
        raise InvalidArgument(f"revision={revision!r} selects a version of a Hub repository, but model={name!r} is "
                              f"{'a tiny checkpoint' if tiny_variant else 'a local folder'}; drop revision, or "
                              "pass a Hub id.")
    index, meta = _read_index(root, name, hub)
    index_path = root / "model_index.json"
    loaded = ("text_encoder", "vae") + (("image_encoder",) if meta.image_encoder else ())  # besides the DiT
    components = REQUIRED + meta.experts[1:] + (IMAGE_COMPONENTS if meta.image_encoder else ())
    if hub:  # only the files fastwan reads (hub.py)
        weighted = {c: c in TRANSFORMERS_LOADED for c in meta.experts + loaded}
        root = fetch_components(name, root.name if HUB_COMMIT.match(root.name) else revision, weighted,
                                tuple(c for c in components if c not in weighted), allow_pickle)
    check_components(root, index_path, components)
    configs = _expert_configs(root, meta)
    dit_path = root / meta.experts[0] / "config.json"
    _check_vace(index.get("_class_name") == VACE_PIPELINE, configs[0], dit_path)
    dit_raw = read_json(dit_path, missing="")
    check_causal_dit(meta.causal, dit_raw.get("_class_name"), str(dit_path))
    recipe = fastvideo_recipe(dit_raw, str(dit_path)) if meta.causal else None
    check_latent_channels(root, configs[0])
    check_text_width(root, configs[0])
    if meta.image_encoder:
        clip_path = root / "image_encoder" / "config.json"
        check_clip(read_json(clip_path, missing="the image_encoder component needs it."), configs[0], clip_path)
    files = {comp: weight_files(root / comp, allow_pickle=allow_pickle, single_first=comp in TRANSFORMERS_LOADED)
             for comp in meta.experts + loaded}
    for comp in loaded:
        check_loader_files(root / comp, comp, files[comp])
    gates = [check_transformer_files(files[e], cfg, str(root / e)) for e, cfg in zip(meta.experts, configs)]
    scheduler_class(index, root, warn=True)

    expand = meta.expand_timesteps
    two = len(meta.experts) == 2
    if meta.animate:
        variant = "wan2.2-animate"
    elif meta.image_to_video and not expand:
        variant = "wan2.2-i2v-a14b" if two else ("wan2.1-flf2v" if configs[0].pos_embed_seq_len else "wan2.1-i2v")
    else:
        variant = "wan2.2-a14b" if two else ("wan2.2-ti2v" if expand or configs[0].in_channels == 48 else "wan2.1")
    preset = checkpoint_preset(variant, configs[0].inner_dim, checkpoint_label(name, root, hub), meta.distilled)
    if recipe is not None:
        preset = causal_preset(preset, recipe, configs[0].inner_dim)
    return Checkpoint(root, variant, preset, index, configs[0], meta.experts, meta.boundary_ratio, expand,
                      meta.image_encoder, meta.distilled, gates[0],
                      {comp: weight_variant(fs) for comp, fs in files.items()}, meta.image_to_video, recipe)
