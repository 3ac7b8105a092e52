"""Random checkpoints for the benchmarks: at the real Wan shapes (the FLOPs and kernels of the published models;
quality is not measured), derived layouts (FastWan, Wan2.2-A14B) sharing their weight files, a random LoRA, and the
tiny ones of ``--smoke`` runs (fastwan's tiny writer).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import MappingProxyType

import torch

from benchmarks.editing_inputs import CLASS_NAMES, peer_class, peer_kwargs
from benchmarks.harness import TASKS, TEXT_DIM, log

TINY_VARIANTS = MappingProxyType({"t2v": "wan2.1", "i2v": "wan2.1-i2v", "i2v-a14b": "wan2.2-i2v-a14b",
                                  "vace": "wan2.1-vace", "animate": "wan2.2-animate", "ti2v": "wan2.2-ti2v"})
EDIT_SHIFTS = MappingProxyType({"vace": 3.0, "animate": 5.0})  # the scheduler shift of Wan2.1-VACE (480p) and
# Wan2.2-Animate (its animate_14B config); neither has a second expert
PIPELINES = MappingProxyType({"t2v": "WanPipeline", "vace": "WanVACEPipeline", "animate": "WanAnimatePipeline"})

CLIP_VIT_H = MappingProxyType(dict(  # the Wan2.1 I2V image encoder's shape (ViT-H/14, 257 tokens of 1280)
    hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16, image_size=224,
    patch_size=14, projection_dim=1024, hidden_act="gelu"))

def tiny_checkpoint(root: Path, task: str = "t2v") -> Path:
    """``root`` holding fastwan's tiny random checkpoint of ``task`` (:data:`TINY_VARIANTS`), written there (whole
    or not at all) unless a checkpoint is there already: the weights of a ``--smoke`` run."""
    from fastwan.checkpoint.tiny import write_tiny_checkpoint

    root = Path(root)
    if (root / "model_index.json").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}-"))
    try:
        write_tiny_checkpoint(tmp, TINY_VARIANTS[task])
        try:
            os.replace(tmp, root)
        except OSError:  # another run wrote it first, or root is a folder that holds something else
            if not (root / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"tiny {task} checkpoint at {root}")
    return root


def transformer_config(root: Path) -> dict:
    """The DiT's config.json of the checkpoint at ``root``."""
    return json.loads((Path(root) / "transformer" / "config.json").read_text())


def make_checkpoint(root: Path, size: str, task: str = "t2v", device: torch.device | str = "cuda",
                    text_encoder_from: Path | None = None) -> None:
    """Random weights at the real shapes of a Wan2.1 ``size`` and ``task`` (:data:`TASKS`, or "vace" / "animate":
    :func:`benchmarks.editing_inputs.peer_kwargs`' DiT; size "tiny": fastwan's tiny checkpoint of the task,
    :func:`tiny_checkpoint`, on the host whatever ``device``), saved as a Diffusers-format folder: bf16 DiT and
    UMT5-XXL, fp32 VAE; "i2v" and "animate" add a ViT-H CLIP vision encoder (fp32) and its image processor;
    "i2v-a14b" links ``transformer_2`` to ``transformer`` (the experts load as separate tensors, so time and memory
    are those of two experts). ``text_encoder_from``: another such checkpoint whose UMT5-XXL this one links to
    (saves 11 GB of disk)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    from fastwan.checkpoint.tiny import _tokenizer

    root = Path(root)
    if (root / "model_index.json").exists():
        log(f"checkpoint exists at {root}")
        return
    if size == "tiny":
        tiny_checkpoint(root, task)
        return
    shift, boundary = (EDIT_SHIFTS[task], None) if task in EDIT_SHIFTS else TASKS[task][1:]
    t0 = time.time()
    with torch.device(device):
        torch.manual_seed(0)
        m = peer_class(task)(**peer_kwargs(size, task)).to(torch.bfloat16)
        m.save_pretrained(root / "transformer", safe_serialization=True, max_shard_size="10GB")
        del m
        cfg = UMT5Config(vocab_size=256384, d_model=TEXT_DIM, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                         feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                         relative_attention_max_distance=128, dense_act_fn="gelu_new", is_gated_act=True,
                         tie_word_embeddings=False)
        if text_encoder_from is not None:
            (root / "text_encoder").symlink_to(Path(text_encoder_from).resolve() / "text_encoder",
                                               target_is_directory=True)
        else:
            te = UMT5EncoderModel(cfg).to(torch.bfloat16)
            te.save_pretrained(root / "text_encoder", safe_serialization=True, max_shard_size="10GB")
            del te
        AutoencoderKLWan().save_pretrained(root / "vae", safe_serialization=True)
        if task in ("i2v", "animate"):
            from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

            CLIPVisionModel(CLIPVisionConfig(**CLIP_VIT_H)).save_pretrained(root / "image_encoder",
                                                                            safe_serialization=True)
            CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                               resample=3).save_pretrained(root / "image_processor")
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    if boundary is not None:
        (root / "transformer_2").symlink_to("transformer", target_is_directory=True)
    _tokenizer().save_pretrained(root / "tokenizer")
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                            num_train_timesteps=1000).save_pretrained(root / "scheduler")
    (root / "model_index.json").write_text(json.dumps(model_index(task, boundary)))
    log(f"made random {size} {task} checkpoint in {time.time() - t0:.1f}s")


def model_index(task: str, boundary: float | None = None) -> dict:
    """model_index.json of a :func:`make_checkpoint` checkpoint of ``task`` (``boundary``: the A14B boundary ratio,
    None with one DiT): diffusers' pipeline of the task and its components. VACE and Animate have no
    ``expand_timesteps``; Animate no second expert either."""
    dit = ["diffusers", CLASS_NAMES.get(task, "WanTransformer3DModel")]
    index = {"_class_name": PIPELINES.get(task, "WanImageToVideoPipeline"), "_diffusers_version": "0.35.0",
             "scheduler": ["diffusers", "UniPCMultistepScheduler"],
             "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", "T5TokenizerFast"],
             "transformer": dit, "transformer_2": dit if boundary is not None else [None, None],
             "vae": ["diffusers", "AutoencoderKLWan"], "boundary_ratio": boundary, "expand_timesteps": False}
    if task in ("vace", "animate"):
        del index["expand_timesteps"]
    if task == "animate":
        for key in ("transformer_2", "boundary_ratio"):
            del index[key]
    if task not in ("t2v", "vace"):
        clip = task in ("i2v", "animate")
        index["image_encoder"] = ["transformers", "CLIPVisionModel"] if clip else [None, None]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"] if clip else [None, None]
    return index


def _linked_copy(plain: Path, root: Path, skip: tuple[str, ...]) -> bool:
    """Create ``root`` with a link to each of ``plain``'s components but ``skip`` -> False (nothing done) when
    ``root`` already holds a checkpoint."""
    if (root / "model_index.json").exists():
        log(f"checkpoint exists at {root}")
        return False
    root.mkdir(parents=True)
    for comp in plain.iterdir():
        if comp.name not in skip:
            (root / comp.name).symlink_to(comp, target_is_directory=comp.is_dir())
    return True


def _derived_transformer(plain: Path, root: Path, link) -> tuple[Path, Path] | None:
    """``root`` as :func:`_linked_copy` makes it, with a transformer folder of its own holding links to the plain
    one's files whose name ``link`` accepts -> (plain transformer folder, root's), or None when ``root`` exists."""
    if not _linked_copy(plain, root, ("transformer", "model_index.json")):
        return None
    src, dst = plain / "transformer", root / "transformer"
    dst.mkdir()
    for f in src.iterdir():
        if link(f.name):
            (dst / f.name).symlink_to(f)
    return src, dst


def derive_fastwan(plain: Path, root: Path, seed: int = 0) -> None:
    """A FastWan-layout checkpoint (model_index "WanDMDPipeline", the DiT with VSA gate projections) from a
    text-to-video one made by :func:`make_checkpoint`: every component is a link to ``plain``'s; the transformer
    folder links its weight files and adds ``gates.safetensors`` (random bf16 ``to_gate_compress``, FastVideo's
    names), listed in its shard index (written when the plain checkpoint has a single weight file: a loader reads
    only the files an index names or the ``diffusion_pytorch_model`` ones, never a stray file beside them)."""
    from safetensors.torch import save_file

    plain, root = Path(plain).resolve(), Path(root)
    folders = _derived_transformer(plain, root, lambda name: not name.endswith(".index.json"))
    if folders is None:
        return
    src, dst = folders
    cfg = json.loads((src / "config.json").read_text())
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    g = torch.Generator().manual_seed(seed)
    gates = {}
    for i in range(cfg["num_layers"]):
        gates[f"blocks.{i}.to_gate_compress.weight"] = (torch.randn(dim, dim, generator=g) * dim ** -0.5).to(
            torch.bfloat16)
        gates[f"blocks.{i}.to_gate_compress.bias"] = torch.zeros(dim, dtype=torch.bfloat16)
    save_file(gates, str(dst / "gates.safetensors"))
    indexes = {index.name: json.loads(index.read_text()) for index in src.glob("*.safetensors.index.json")}
    if not indexes:
        from safetensors import safe_open

        single = src / "diffusion_pytorch_model.safetensors"
        with safe_open(str(single), framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), single.name)
        indexes = {f"{single.name}.index.json": {"metadata": {}, "weight_map": weight_map}}
    for name, data in indexes.items():
        data["weight_map"].update({k: "gates.safetensors" for k in gates})
        (dst / name).write_text(json.dumps(data))
    model_index = json.loads((plain / "model_index.json").read_text())
    (root / "model_index.json").write_text(json.dumps({**model_index, "_class_name": "WanDMDPipeline"}))
    log(f"derived FastWan-layout checkpoint {root} from {plain}")


def derive_causal(plain: Path, root: Path) -> None:
    """FastVideo's causal layout (model_index "WanCausalDMDPipeline", a "CausalWanTransformer3DModel" DiT at
    FastVideo's causal defaults) from a text-to-video checkpoint made by :func:`make_checkpoint`: a causal DiT has
    the plain one's tensors, so every component and weight file is a link to ``plain``'s."""
    plain, root = Path(plain).resolve(), Path(root)
    folders = _derived_transformer(plain, root, lambda name: name != "config.json")
    if folders is None:
        return
    src, dst = folders
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "_class_name": "CausalWanTransformer3DModel",
                                                 "num_frames_per_block": 3, "local_attn_size": -1, "sink_size": 0}))
    model_index = json.loads((plain / "model_index.json").read_text())
    (root / "model_index.json").write_text(json.dumps({**model_index, "_class_name": "WanCausalDMDPipeline"}))
    log(f"derived causal-layout checkpoint {root} from {plain}")


def derive_a14b(plain: Path, root: Path, shift: float = 12.0, boundary: float = 0.875) -> None:
    """A Wan2.2-T2V-A14B-layout checkpoint from a Wan2.1-14B text-to-video one made by :func:`make_checkpoint`
    (each A14B expert has the Wan2.1-14B DiT's shape): every component links to ``plain``'s, ``transformer_2``
    links to ``transformer`` (the experts still load as separate tensors), model_index carries ``boundary`` and
    the scheduler ``shift`` (Wan2.2's T2V-A14B settings)."""
    from diffusers import UniPCMultistepScheduler

    plain, root = Path(plain).resolve(), Path(root)
    if not _linked_copy(plain, root, ("model_index.json", "scheduler", "transformer_2")):
        return
    (root / "transformer_2").symlink_to(plain / "transformer", target_is_directory=True)
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                            num_train_timesteps=1000).save_pretrained(root / "scheduler")
    index = json.loads((plain / "model_index.json").read_text())
    index.update(transformer_2=index["transformer"], boundary_ratio=boundary)
    (root / "model_index.json").write_text(json.dumps(index))
    log(f"derived A14B-layout checkpoint {root} from {plain}")


def write_lora(path: Path, dit: dict, rank: int = 64, seed: int = 0) -> None:
    """A random rank-``rank`` LoRA in the original-Wan (lightx2v) layout on every attention and FFN linear of a
    DiT of config ``dit`` (:func:`~benchmarks.harness.dit_kwargs`, or a checkpoint's :func:`transformer_config`):
    ``diffusion_model.blocks.N.<module>.lora_down/lora_up.weight`` and ``.alpha``, bf16."""
    from safetensors.torch import save_file

    kw = dit
    dim, ffn = kw["num_attention_heads"] * kw["attention_head_dim"], kw["ffn_dim"]
    shapes = {f"{a}.{p}": (dim, dim) for a in ("self_attn", "cross_attn") for p in "qkvo"}
    shapes.update({"ffn.0": (ffn, dim), "ffn.2": (dim, ffn)})
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(kw["num_layers"]):
        for name, (o, n) in shapes.items():
            key = f"diffusion_model.blocks.{i}.{name}"
            out[f"{key}.lora_down.weight"] = (torch.randn(rank, n, generator=g) * n ** -0.5).to(torch.bfloat16)
            out[f"{key}.lora_up.weight"] = (torch.randn(o, rank, generator=g) * 1e-3).to(torch.bfloat16)
            out[f"{key}.alpha"] = torch.tensor(float(rank))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path))
    log(f"wrote random rank-{rank} LoRA ({kw['num_layers']} blocks) to {path}")


def write_taehv(path: Path, latent_channels: int = 16, seed: int = 0) -> Path:
    """``path`` holding a random TAEHV decoder in the layout of the published file for ``latent_channels`` (16:
    taew2_1, 48: taew2_2), written there (whole or not at all) unless a file is there already: the ``decoder.``
    keys and shapes ``vae="tiny"`` reads (:mod:`fastwan.vae.tiny_weights`), fp32 safetensors. The published files'
    ``encoder.`` keys are left out: nothing reads them. Weights are normal with std 1 / sqrt(fan_in), biases zero."""
    from safetensors.torch import save_file

    from fastwan.vae.tiny import TinyDecoder
    from fastwan.vae.tiny_weights import VARIANTS

    path = Path(path)
    if path.is_file():
        return path
    if latent_channels not in VARIANTS:
        raise ValueError(f"latent_channels={latent_channels}: TAEHV's Wan decoders take {sorted(VARIANTS)}")
    name, patch = VARIANTS[latent_channels]
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in TinyDecoder(latent_channels, patch).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.zeros(shape) if len(shape) == 1 else torch.randn(shape, generator=g) / shape[1:].numel() ** 0.5
             for k, shape in shapes.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        save_file(state, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"wrote a random {name} TAEHV decoder to {path}")
    return path
