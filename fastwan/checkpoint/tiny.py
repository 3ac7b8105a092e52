"""Tiny random Wan checkpoints in the Diffusers layout, written offline (tests, CI, the README's first command).

Three variants, the same component layout as the published checkpoints:

- ``wan2.1``: transformer + UMT5 text encoder + tokenizer + ``AutoencoderKLWan`` + UniPC scheduler;
- ``wan2.2-a14b``: two experts (``transformer``, ``transformer_2``) and ``boundary_ratio`` in model_index.json;
- ``wan2.2-ti2v``: 48-channel latents, the residual VAE (spatial factor 16) and ``expand_timesteps``.
- ``wan2.1-vace`` / ``wan2.2-vace-a14b``: diffusers' ``WanVACEPipeline`` layout (``WanVACETransformer3DModel``,
  3 blocks with VACE hints after blocks 0 and 2), with one or two experts.
- ``sfwan2.1``: FastVideo's causal layout (``WanCausalDMDPipeline``, a ``CausalWanTransformer3DModel`` DiT whose
  config.json holds FastVideo's causal keys at their defaults: 3 frames per chunk, no window, no sinks).

:func:`write_generator_file` writes a Self-Forcing / CausVid style generator file (original Wan names under
``model.``, nested under ``generator`` / ``generator_ema``) of a tiny checkpoint's DiT shapes.

Weights are random (seeded), saved as safetensors (optionally sharded, with an index, as the published
checkpoints are). The tokenizer is a small Unigram model built in code, so nothing is downloaded.
:func:`write_hub_cache` lays a checkpoint folder out as the Hugging Face cache does, to load it by Hub id
offline.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from types import MappingProxyType

import torch

from fastwan.errors import InvalidArgument, MissingFileError, OutputExistsError
from fastwan.checkpoint.files import new_file_mode, new_temp_folder, set_file_modes
from fastwan.checkpoint.safetensors import HUB_COMMIT, HUB_MODEL_ID, PICKLE_SUFFIXES, header_tensors

CAUSAL_PIPELINE, CAUSAL_DIT_CLASS = "WanCausalDMDPipeline", "CausalWanTransformer3DModel"  # FastVideo's names

VARIANTS = ("wan2.1", "wan2.2-a14b", "wan2.2-ti2v", "fastwan2.1")  # fastwan2.1: FastWan's layout (DMD, VSA gates)
IMAGE_VARIANTS = ("wan2.1-i2v", "wan2.1-flf2v", "wan2.2-i2v-a14b")  # WanImageToVideoPipeline layouts
VACE_VARIANTS = ("wan2.1-vace", "wan2.2-vace-a14b")  # WanVACEPipeline layouts (Wan2.1-VACE, Wan2.2-VACE-Fun-A14B)
ANIMATE_VARIANTS = ("wan2.2-animate",)  # WanAnimatePipeline's layout (Wan2.2-Animate-14B)
CAUSAL_VARIANTS = ("sfwan2.1",)  # FastVideo's causal layout (SFWan2.1-T2V-1.3B-Diffusers)
# the causal keys FastVideo's causal DiT config carries (fastwan.checkpoint.causal_layouts.FASTVIDEO_DIT_DEFAULTS)
TINY_CAUSAL_DIT = {"num_frames_per_block": 3, "local_attn_size": -1, "sink_size": 0, "sliding_window_num_frames": 21}
TINY_CAUSAL_SCHEDULER = {"_class_name": "SelfForcingFlowMatchScheduler", "num_inference_steps": 1000, "shift": 5.0,
                         "sigma_min": 0.0, "extra_one_step": True, "training": True}
# the tiny Animate DiT's own keys: a face adapter after blocks 0 and 2 of 4, face frames of 16 x 16 pixels
TINY_ANIMATE_DIT = MappingProxyType(dict(
    motion_encoder_channel_sizes=MappingProxyType({"4": 8, "8": 6, "16": 5}), motion_encoder_size=16,
    motion_style_dim=8, motion_dim=4, motion_encoder_dim=7, face_encoder_hidden_dim=6, face_encoder_num_heads=2,
    inject_face_latents_blocks=2, motion_encoder_batch_size=5))
TINY_VACE_LAYERS = (0, 2)  # of 3 blocks: a hint after the first and the last, none after the middle one
TINY_IDS = {
    "tiny": "wan2.1",
    "tiny-wan2.1": "wan2.1",
    "tiny-wan2.2-a14b": "wan2.2-a14b",
    "tiny-wan2.2-ti2v": "wan2.2-ti2v",
    "tiny-wan2.1-i2v": "wan2.1-i2v",
    "tiny-wan2.1-flf2v": "wan2.1-flf2v",
    "tiny-wan2.2-i2v-a14b": "wan2.2-i2v-a14b",
    "tiny-fastwan2.1": "fastwan2.1",
    "tiny-wan2.2-animate": "wan2.2-animate",
}
CLIP_IMAGE_SIZE, CLIP_PATCH, CLIP_DIM = 32, 8, 16  # the tiny CLIP: (32 / 8)^2 + 1 = 17 tokens of width 16
_FORMAT = 2  # bump when the tiny layout changes, so cached copies are rebuilt
MANIFEST = ".fastwan-tiny.json"  # in a cached tiny checkpoint: the sha256 of each of its files

TEXT_DIM = 32


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-")
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [(c, -3.0) for c in chars] + [("\u2581" + c, -2.5) for c in chars]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0)


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _check_variant(variant: str) -> None:
    """Rule: a tiny variant is one of :data:`VARIANTS` or :data:`IMAGE_VARIANTS`."""
    known = VARIANTS + IMAGE_VARIANTS + VACE_VARIANTS + ANIMATE_VARIANTS + CAUSAL_VARIANTS
    if variant not in known:
        raise InvalidArgument(f"tiny variant {variant!r} is unknown; use one of {', '.join(known)}.")


def _write_clip(path: Path, seed: int) -> None:
    """A tiny CLIP vision encoder and its image processor (``image_encoder/``, ``image_processor/``)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    enc = CLIPVisionModel(CLIPVisionConfig(hidden_size=CLIP_DIM, intermediate_size=32, num_hidden_layers=3,
                                           num_attention_heads=2, image_size=CLIP_IMAGE_SIZE,
                                           patch_size=CLIP_PATCH)).eval()
    _randomize(enc, seed + 1, std=0.3)
    enc.save_pretrained(path / "image_encoder", safe_serialization=True)
    CLIPImageProcessor(size={"shortest_edge": CLIP_IMAGE_SIZE},
                       crop_size={"height": CLIP_IMAGE_SIZE, "width": CLIP_IMAGE_SIZE}).save_pretrained(
        path / "image_processor")


def write_tiny_checkpoint(path: str | Path, variant: str = "wan2.1", *, seed: int = 0,
                          max_shard_size: int | None = None) -> Path:
    """Write a tiny random checkpoint of ``variant`` (one of :data:`VARIANTS`) to ``path``; returns it.

    ``max_shard_size`` (bytes): the transformer(s) and the text encoder are saved as safetensors shards of at
    most this size plus a ``*.safetensors.index.json`` (the layout of the published checkpoints); None (the
    default) saves each as one file. The weights are the same either way.

    Rule: the checkpoint is written into a new hidden folder beside ``path`` and moved onto ``path`` whole, so a
    failed or killed write leaves no partial checkpoint; ``path`` must not exist yet or be an empty folder.
    """
    _check_variant(variant)
    if max_shard_size is not None and (isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int)
                                       or max_shard_size <= 0):
        raise InvalidArgument(f"max_shard_size={max_shard_size!r} must be a positive int (bytes) or None "
                              "(one file per component), e.g. 40_000 splits the tiny models into a few shards.")
    path = Path(path)
    if path.is_dir() and any(path.iterdir()):
        raise OutputExistsError(f"{path} is not empty (it holds {sorted(p.name for p in path.iterdir())[:3]}); "
                                "a tiny checkpoint is written into a new or empty folder: pass another path.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temp_folder(path.parent, f".{path.name}-", ".tmp")
    try:
        _write(tmp, variant, seed, {} if max_shard_size is None else {"max_shard_size": max_shard_size})
        os.replace(tmp, path)  # onto a missing path or an empty folder: whole, in one step
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write(path: Path, variant: str, seed: int, shard: dict) -> None:
    """The files of a tiny checkpoint of ``variant``, into the existing empty folder ``path``."""
    from diffusers import (AutoencoderKLWan, UniPCMultistepScheduler, WanAnimateTransformer3DModel,
                           WanTransformer3DModel, WanVACETransformer3DModel)
    from transformers import UMT5Config, UMT5EncoderModel

    ti2v = variant == "wan2.2-ti2v"
    channels = 48 if ti2v else 16
    animate = variant in ANIMATE_VARIANTS
    image = variant in IMAGE_VARIANTS or animate  # the DiT reads noise, mask and condition latents
    clip = variant in ("wan2.1-i2v", "wan2.1-flf2v") or animate
    vace = variant in VACE_VARIANTS
    dit_class, layers = ((WanVACETransformer3DModel, 3) if vace else (WanAnimateTransformer3DModel, 4) if animate
                         else (WanTransformer3DModel, 2))
    tokens = (CLIP_IMAGE_SIZE // CLIP_PATCH) ** 2 + 1
    image_cfg = dict(image_dim=CLIP_DIM if clip else None, added_kv_proj_dim=24 if clip else None,
                     pos_embed_seq_len=2 * tokens if variant == "wan2.1-flf2v" else None)
    if vace:  # the control latents: the video's inactive and reactive latents and the 8 x 8 mask's 64 channels
        image_cfg = dict(image_cfg, vace_layers=list(TINY_VACE_LAYERS), vace_in_channels=2 * channels + 64)
    if animate:
        sizes = dict(TINY_ANIMATE_DIT["motion_encoder_channel_sizes"])  # a JSON object in the config
        image_cfg = dict(image_cfg, latent_channels=channels,
                         **{**TINY_ANIMATE_DIT, "motion_encoder_channel_sizes": sizes})

    tokenizer = _tokenizer()
    tokenizer.save_pretrained(path / "tokenizer")
    te_cfg = UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    )
    torch.manual_seed(seed)
    te = UMT5EncoderModel(te_cfg).eval()
    _randomize(te, seed + 1, std=0.5)
    te.save_pretrained(path / "text_encoder", safe_serialization=True, **shard)

    two = variant in ("wan2.2-a14b", "wan2.2-i2v-a14b", "wan2.2-vace-a14b")
    experts = ["transformer", "transformer_2"] if two else ["transformer"]
    for i, name in enumerate(experts):
        dit = dit_class(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
            in_channels=2 * channels + 4 if image else channels, out_channels=channels, text_dim=TEXT_DIM,
            freq_dim=256, ffn_dim=32, num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            rope_max_seq_len=64, **image_cfg,
        )
        if variant == "fastwan2.1":  # VSA's gate projections, named as FastVideo's FastWan checkpoints name them
            dim = dit.config.num_attention_heads * dit.config.attention_head_dim
            for blk in dit.blocks:
                blk.to_gate_compress = torch.nn.Linear(dim, dim)
        _randomize(dit, seed + 10 + i, std=0.1)
        if animate:  # the motion encoder scales its weights by 1 / sqrt(fan_in) itself: unit ones keep the face's
            _randomize(dit.motion_encoder, seed + 15, std=1.0)  # signal
        dit.save_pretrained(path / name, safe_serialization=True, **shard)
        if variant in CAUSAL_VARIANTS:  # the same tensors; FastVideo's causal class and keys in the config
            cfg_path = path / name / "config.json"
            cfg = {**json.loads(cfg_path.read_text()), "_class_name": CAUSAL_DIT_CLASS, **TINY_CAUSAL_DIT}
            cfg_path.write_text(json.dumps(cfg, indent=2))

    if ti2v:
        vae = AutoencoderKLWan(
            base_dim=8, decoder_base_dim=8, z_dim=48, in_channels=12, out_channels=12, is_residual=True,
            patch_size=2, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
            scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
        )
    else:
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    torch.manual_seed(seed + 20)
    vae.save_pretrained(path / "vae", safe_serialization=True)

    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                    num_train_timesteps=1000)
    sched.save_pretrained(path / "scheduler")
    if variant in CAUSAL_VARIANTS:  # FastVideo's own scheduler class, as SFWan2.1-T2V-1.3B-Diffusers saves it
        (path / "scheduler" / "scheduler_config.json").write_text(json.dumps(TINY_CAUSAL_SCHEDULER, indent=2))

    if clip:
        _write_clip(path, seed + 30)
    index = {
        "_class_name": "WanAnimatePipeline" if animate else "WanImageToVideoPipeline" if image else
        "WanVACEPipeline" if vace else (
            "WanDMDPipeline" if variant == "fastwan2.1" else CAUSAL_PIPELINE if variant in CAUSAL_VARIANTS
            else "WanPipeline"),
        "_diffusers_version": "0.35.0",
        "scheduler": ["diffusers", TINY_CAUSAL_SCHEDULER["_class_name"] if variant in CAUSAL_VARIANTS
                      else "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", CAUSAL_DIT_CLASS if variant in CAUSAL_VARIANTS else dit_class.__name__],
        "transformer_2": ["diffusers", dit_class.__name__] if len(experts) == 2 else [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "boundary_ratio": 0.875 if len(experts) == 2 else None,
        "expand_timesteps": ti2v,
    }
    if vace or animate:  # WanVACEPipeline and WanAnimatePipeline have no expand_timesteps
        del index["expand_timesteps"]
    if animate:  # nor a second expert
        for key in ("transformer_2", "boundary_ratio"):
            del index[key]
    if image:
        index["image_encoder"] = ["transformers", "CLIPVisionModel"] if clip else [None, None]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"] if clip else [None, None]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))


def tiny_cache_dir() -> Path:
    from fastwan import envs

    return Path(envs.cache_dir()) / "tiny"


def _digests(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file of a checkpoint folder (the manifest left out)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}


def _intact(folder: Path) -> bool:
    """Whether ``folder`` holds exactly the files its manifest lists, with their contents."""
    try:
        listed = json.loads((folder / MANIFEST).read_text())
        return isinstance(listed, dict) and listed == _digests(folder)
    except (OSError, ValueError):
        return False


def tiny_checkpoint(variant: str = "wan2.1") -> Path:
    """Path of the cached tiny checkpoint of ``variant``, written on first use. Rule: the cached folder is used
    only while its files are those its manifest (:data:`MANIFEST`, sha256 per file) lists; a corrupt, missing or
    changed file makes it be written again (a tiny checkpoint cannot be downloaded again). Written atomically:
    the new folder is complete before it replaces the old one."""
    _check_variant(variant)
    final = tiny_cache_dir() / f"{variant}-v{_FORMAT}"
    if _intact(final):
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = new_temp_folder(final.parent, f".{variant}-", ".tmp")
    except OSError as exc:
        raise MissingFileError(
            f"the tiny checkpoint cannot be written under {final.parent} ({exc.strerror or exc}); point "
            "FASTWAN_CACHE (or XDG_CACHE_HOME) at a folder you can write to."
        ) from None
    old = None
    try:
        _write(tmp, variant, 0, {})
        (tmp / MANIFEST).write_text(json.dumps(_digests(tmp), indent=1))
        set_file_modes(tmp, new_file_mode(tmp))  # the weights too, which safetensors writes owner-only
        if final.exists():  # damaged: moved aside, then replaced in one step
            old = new_temp_folder(final.parent, f".{variant}-old-", ".tmp")
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race
            if not _intact(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return final


# Files the Hub stores with Git LFS (their cache blob is named by the content's sha256; others by the git sha1).
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".model")
_REF = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*$")  # a branch or tag name


def _blob_name(rel: Path, data: bytes) -> str:
    """The cache's blob name for a file: sha256 of the content for LFS files, else the git blob sha1."""
    if rel.suffix in _LFS_SUFFIXES:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_hub_cache(src: str | Path, cache_dir: str | Path, repo_id: str, *, revision: str | None = None,
                    ref: str = "main") -> Path:
    """Lay the files of folder ``src`` out as huggingface_hub's cache holds model ``repo_id``; the snapshot path.

    The layout: ``<cache_dir>/models--<owner>--<name>/`` with ``blobs/<hash>`` (each distinct content once),
    ``refs/<ref>`` (holding the commit hash, no newline) and ``snapshots/<revision>/<path>``, where every file
    is a relative symlink into ``blobs/`` (``../../blobs/<hash>``, one more ``../`` per nested folder).
    ``revision`` (40 hex digits) defaults to a hash of the file listing. With ``HF_HUB_CACHE=<cache_dir>`` and
    ``HF_HUB_OFFLINE=1``, ``snapshot_download(repo_id)`` returns the snapshot.
    """
    src = Path(src)
    if not src.is_dir():
        raise MissingFileError(f"src={str(src)!r} is not a folder; pass the checkpoint folder to lay out.")
    if not isinstance(repo_id, str) or not HUB_MODEL_ID.match(repo_id):
        raise InvalidArgument(f"repo_id={repo_id!r} must be a Hub model id 'owner/name' (e.g. 'Wan-AI/tiny').")
    if revision is not None and not (isinstance(revision, str) and HUB_COMMIT.match(revision)):
        raise InvalidArgument(f"revision={revision!r} must be a commit hash (40 lowercase hex digits) or None.")
    if not isinstance(ref, str) or not _REF.match(ref) or ".." in ref:
        raise InvalidArgument(f"ref={ref!r} must be a branch or tag name such as 'main'.")
    storage = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    files = {p.relative_to(src): p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file()}
    blobs = {rel: _blob_name(rel, data) for rel, data in files.items()}
    if revision is None:
        listing = "".join(f"{rel.as_posix()} {blob}\n" for rel, blob in blobs.items())
        revision = hashlib.sha1(listing.encode()).hexdigest()
    snapshot = storage / "snapshots" / revision
    for rel, data in files.items():
        blob = storage / "blobs" / blobs[rel]
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.is_file():
            blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    ref_file = storage / "refs" / ref
    ref_file.parent.mkdir(parents=True, exist_ok=True)
    ref_file.write_text(revision)
    return snapshot


def original_wan_names(num_layers: int) -> list[str]:
    """The tensor names of the original Wan release's text-to-video DiT (``WanModel``) of ``num_layers`` blocks, as
    its state dict (and Self-Forcing's / CausVid's wrappers, under ``model.``) holds them."""
    linear = ("weight", "bias")
    names = [f"patch_embedding.{t}" for t in linear]
    for module in ("text_embedding.0", "text_embedding.2", "time_embedding.0", "time_embedding.2",
                   "time_projection.1", "head.head"):
        names += [f"{module}.{t}" for t in linear]
    names.append("head.modulation")
    for i in range(num_layers):
        b = f"blocks.{i}"
        for attn in ("self_attn", "cross_attn"):
            names += [f"{b}.{attn}.{m}.{t}" for m in "qkvo" for t in linear]
            names += [f"{b}.{attn}.norm_q.weight", f"{b}.{attn}.norm_k.weight"]
        names += [f"{b}.norm3.{t}" for t in linear] + [f"{b}.ffn.{m}.{t}" for m in "02" for t in linear]
        names.append(f"{b}.modulation")
    return names


def write_generator_file(path: str | Path, base: str | Path, *, entries: tuple[str, ...] = ("generator",
                         "generator_ema"), prefix: str = "model.", seed: int = 0) -> Path:
    """Write a generator file as Self-Forcing and CausVid release theirs, for the DiT of the tiny checkpoint folder
    ``base`` (its transformer/ shapes): random tensors (one draw per entry, ``seed`` first) under the original Wan
    names (:func:`original_wan_names`) with ``prefix``, each entry a state dict under its name (``entries`` empty:
    one flat state dict). A pickle (``.pt``, ...) nests them as ``torch.save`` does, with a ``critic`` entry as
    Self-Forcing's training saves; ``.safetensors`` spells the nesting as name prefixes. Returns ``path``."""
    from fastwan.models.wan.names import dit_name

    path = Path(path)
    shapes = {k: shape for k, (shape, _) in header_tensors(sorted((Path(base) / "transformer").glob(
        "*.safetensors"))).items()}
    layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))
    original = {dit_name(n): n for n in original_wan_names(layers)}
    if set(original) != set(shapes):
        raise InvalidArgument(f"{base}'s DiT is not a plain Wan2.1 text-to-video DiT (its tensors "
                              f"{sorted(set(shapes) ^ set(original))[:3]} ...); pass a tiny wan2.1 checkpoint.")
    g = torch.Generator().manual_seed(seed)
    states = [{f"{prefix}{original[k]}": torch.randn(shape, generator=g) * 0.1 for k, shape in sorted(shapes.items())}
              for _ in entries or ("",)]
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        flat = {f"{e}.{k}" if e else k: v for e, sd in zip(entries or ("",), states) for k, v in sd.items()}
        save_file(flat, str(path))
    elif path.suffix in PICKLE_SUFFIXES:
        tree = dict(zip(entries, states)) if entries else states[0]
        if entries:
            tree["critic"] = {f"{prefix}head.modulation": torch.zeros(1, 2, 4)}  # another model's, never read
        torch.save(tree, path)
    else:
        raise InvalidArgument(f"path={str(path)!r} must end in .safetensors or a pickle suffix "
                              f"({', '.join(PICKLE_SUFFIXES)}).")
    return path
