"""Resolve a model argument (Hub id, local folder, ``tiny``) to a checked Diffusers-format Wan checkpoint."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from fastwan.models.config import WanConfig
from fastwan.models.loading import read_json, weight_files
from fastwan.testing import TINY_IDS, tiny_checkpoint


@dataclass(frozen=True)
class Preset:
    """Generation defaults a model gets when the caller passes ``None``."""

    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    guidance_scale_2: float | None
    fps: int


PRESETS = {
    "wan2.1": Preset(480, 832, 81, 50, 5.0, None, 16),
    "wan2.2-a14b": Preset(720, 1280, 81, 40, 4.0, 3.0, 16),
    "wan2.2-ti2v": Preset(704, 1280, 121, 50, 5.0, None, 24),
}
# tiny checkpoints: the same kinds of models at sizes a 2-core CPU makes in seconds
TINY_PRESETS = {
    "wan2.1": Preset(128, 128, 17, 8, 5.0, None, 8),
    "wan2.2-a14b": Preset(128, 128, 17, 8, 4.0, 3.0, 8),
    "wan2.2-ti2v": Preset(128, 128, 17, 8, 5.0, None, 8),
}

# Wan's own default negative prompt (the one FastVideo's presets and the Wan repo use).
WAN_NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，"
    "丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，"
    "静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走"
)

REQUIRED = ("transformer", "text_encoder", "tokenizer", "vae", "scheduler")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    variant: str  # one of PRESETS
    preset: Preset
    index: dict
    transformer_config: WanConfig
    experts: tuple[str, ...]  # ("transformer",) or ("transformer", "transformer_2")
    boundary_ratio: float | None
    expand_timesteps: bool

    def folder(self, component: str) -> Path:
        return self.root / component


def _download(model_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(model_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as exc:
        raise FileNotFoundError(
            f"model {model_id!r} is neither a local folder nor a Hub repository you can access ({type(exc).__name__}). "
            "Pass a Diffusers-format Wan folder, a Hub id such as 'Wan-AI/Wan2.1-T2V-1.3B-Diffusers', or 'tiny'."
        ) from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {model_id!r} is not a local folder and is not in the Hugging Face cache, and the Hub cannot be "
            "reached (offline or HF_HUB_OFFLINE=1). Download it first or pass a local folder."
        ) from None


def resolve(model: str | Path, *, allow_pickle: bool = False) -> Checkpoint:
    """Check everything that can be checked without loading weights; raise early with a clear message."""
    if not isinstance(model, (str, Path)):
        raise TypeError(f"model={model!r} must be a Hub id, a folder path or 'tiny', not {type(model).__name__}.")
    name = str(model)
    tiny_variant = TINY_IDS.get(name)
    if tiny_variant is not None:
        root = tiny_checkpoint(tiny_variant)
    elif Path(name).expanduser().exists():
        root = Path(name).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"model {name!r} is a file; pass the checkpoint folder (with model_index.json).")
    elif _HUB_ID.match(name) and not name.startswith((".", "/", "~")):
        root = _download(name)
    else:
        raise FileNotFoundError(
            f"model {name!r} is not a folder that exists, not a Hub id (owner/name), and not one of "
            f"{', '.join(TINY_IDS)}. Check the path or the model id."
        )

    index_path = root / "model_index.json"
    index = read_json(index_path, missing=f"{root} is not a Diffusers-format pipeline folder.")
    cls = index.get("_class_name", "")
    if not (isinstance(cls, str) and cls.startswith("Wan")):
        raise ValueError(f"{index_path} describes a {cls!r} pipeline, not a Wan pipeline (WanPipeline).")
    for comp in REQUIRED:
        if not (root / comp).is_dir():
            raise FileNotFoundError(
                f"checkpoint {root} is missing its '{comp}/' component; a Wan checkpoint needs {', '.join(REQUIRED)}."
            )
    has_second = bool(index.get("transformer_2")) and index["transformer_2"][0] is not None
    experts = ("transformer", "transformer_2") if has_second else ("transformer",)
    if has_second and not (root / "transformer_2").is_dir():
        raise FileNotFoundError(f"{index_path} lists transformer_2, but {root / 'transformer_2'} is missing.")
    configs = [WanConfig.from_file(root / e / "config.json") for e in experts]
    for e in experts:
        weight_files(root / e, allow_pickle=allow_pickle)
    for comp in ("text_encoder", "vae"):
        weight_files(root / comp, allow_pickle=allow_pickle)
    read_json(root / "scheduler" / "scheduler_config.json", missing="the scheduler component needs it.")

    boundary = index.get("boundary_ratio")
    if has_second and boundary is None:
        raise ValueError(f"{index_path} has two experts but no boundary_ratio; it cannot tell when to switch.")
    expand = bool(index.get("expand_timesteps", False))
    variant = "wan2.2-a14b" if has_second else ("wan2.2-ti2v" if expand or configs[0].in_channels == 48 else "wan2.1")
    preset = (TINY_PRESETS if tiny_variant else PRESETS)[variant]
    return Checkpoint(root, variant, preset, index, configs[0], experts, boundary, expand)


def with_overrides(preset: Preset, **kw) -> Preset:
    return replace(preset, **{k: v for k, v in kw.items() if v is not None})
