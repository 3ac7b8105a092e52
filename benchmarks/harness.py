"""What the GPU benchmarks share: logging and versions, CUDA timing, the Wan inputs and shapes, a random checkpoint
at the real shapes, DiT variants as :class:`~fastwan.options.DiTOptions` overrides, the diffusers peers, video
comparison (PSNR/SSIM), kernel-time grouping (torch.profiler) and nvidia-smi sampling.

The benchmarks run from the repository root as modules, ``python -m benchmarks.<name>``. An A/B variant is data
(DiTOptions overrides, an attention config, a ``cfg_mode``) that builds its own model or generator; nothing
changes a built one.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from fastwan.options import DiTOptions
from fastwan.profiler import span_time, time_fn

H, W, F = 480, 832, 81  # Wan2.1 1.3B's video: 21 x 30 x 52 = 32,760 tokens
PROMPT = "a red fox running through fresh snow in a pine forest, cinematic lighting"
NEG = "blurry, low quality, static"
TEXT_TOKENS, TEXT_DIM = 512, 4096  # the pipelines pad every prompt to 512 UMT5 rows

DIT_COMMON = MappingProxyType(dict(
    patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=TEXT_DIM, freq_dim=256,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024))
DIT_SIZES = MappingProxyType({  # the DiT shape of each Wan2.1 size, and its job's video (frames, height, width)
    "1.3b": (MappingProxyType(dict(num_attention_heads=12, ffn_dim=8960, num_layers=30)), (81, 480, 832)),
    "14b": (MappingProxyType(dict(num_attention_heads=40, ffn_dim=13824, num_layers=40)), (81, 720, 1280)),
})
PEERS = MappingProxyType({
    "diffusers": "as installed (eager, default attention), fp32 VAE",
    "diffusers_tuned": "compile_repeated_blocks(fullgraph=True) + _native_cudnn, fp32 VAE",
})


def log(*a) -> None:
    print(*a, flush=True)


def versions() -> dict:
    import diffusers
    import transformers

    v = {"torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": diffusers.__version__,
         "transformers": transformers.__version__, "device": torch.cuda.get_device_name(0),
         "cudnn": torch.backends.cudnn.version()}
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        pass
    return v


# ---- timing ----------------------------------------------------------------------------------------------

def cuda_time(fn: Callable[[], Any], warmup: int = 2, iters: int = 5) -> float:
    """Median milliseconds of fn() over ``iters`` calls (CUDA events, one synchronised call at a time), after
    ``warmup`` calls."""
    return statistics.median(time_fn(fn, warmup=warmup, iters=iters, device=torch.device("cuda")))


def span_ms(fn: Callable[[], Any], calls: int = 10, rounds: int = 3) -> float:
    """Median over ``rounds`` of the ms per call of ``calls`` back-to-back calls (one span, CUDA events)."""
    return statistics.median(span_time(fn, calls=calls, device=torch.device("cuda")) for _ in range(rounds))


def smi() -> tuple[float, float]:
    """(SM clock MHz, power W) of GPU 0 as nvidia-smi reports them now; NaNs when it cannot be asked."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout.split("\n")[0]
        mhz, w = (float(x) for x in out.split(","))
        return mhz, w
    except Exception:
        return float("nan"), float("nan")


def smi_round(fn: Callable[[], Any], calls: int) -> tuple[float, float, float]:
    """(median ms per call, SM MHz, W) of ``calls`` calls each between two CUDA events, with the clock and power
    sampled mid-round (the queue holds the rest of the round while nvidia-smi answers)."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    sample = (float("nan"), float("nan"))
    for i, (start, end) in enumerate(ev):
        start.record()
        fn()
        end.record()
        if i == calls // 2:
            sample = smi()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev), *sample


def release(compiled: bool, device: torch.device | str = "cuda") -> None:
    """Free a finished phase's models (drop your references first): compiled blocks stay referenced by dynamo's
    cache, keeping their weights alive, until it resets; then the allocator's cached blocks go back (CUDA)."""
    if compiled:
        torch._dynamo.reset()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def raise_recompile_limit(limit: int = 64) -> None:
    """Let dynamo keep ``limit`` graphs per code object: variants built side by side compile the same block code,
    each with its own guards."""
    import torch._dynamo.config as dcfg

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dcfg, name):
            setattr(dcfg, name, max(getattr(dcfg, name), limit))


# ---- inputs and shapes -----------------------------------------------------------------------------------

def forward_inputs(batch: int, in_ch: int = 16, h: int = H, w: int = W, f: int = F, prompt_tokens: int = TEXT_TOKENS):
    """(latents, timestep, text) of one DiT forward on CUDA: bf16 latents [batch, in_ch, (f-1)/4+1, h/8, w/8],
    t = 500, and text [batch, 512, 4096] with the rows after ``prompt_tokens`` zeroed as the pipelines pad a
    prompt."""
    if not 0 <= prompt_tokens <= TEXT_TOKENS:
        raise ValueError(f"prompt_tokens={prompt_tokens} must be 0..{TEXT_TOKENS}")
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(batch, in_ch, (f - 1) // 4 + 1, h // 8, w // 8, device="cuda", generator=g).to(torch.bfloat16)
    t = torch.full((batch,), 500.0, device="cuda")
    text = torch.randn(batch, TEXT_TOKENS, TEXT_DIM, device="cuda", generator=g).to(torch.bfloat16)
    text[:, prompt_tokens:] = 0
    return x, t, text


def parse_video(text: str) -> tuple[int, int, int]:
    """'480x832x81' -> (480, 832, 81); ValueError unless three positive ints with H and W multiples of 16 and
    F = 4k + 1."""
    try:
        h, w, f = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--video {text!r}: use HEIGHTxWIDTHxFRAMES, e.g. 480x832x81") from None
    if min(h, w, f) <= 0 or h % 16 or w % 16 or (f - 1) % 4:
        raise ValueError(f"--video {text!r}: height and width must be positive multiples of 16 and frames 4k + 1")
    return h, w, f


def parse_phases(parser, text: str, allowed: tuple[str, ...]) -> list[str]:
    """'make,fastwan' -> the phases in order; an unknown one is the parser's error (exit 2)."""
    phases = text.split(",")
    unknown = [ph for ph in phases if ph not in allowed]
    if unknown:
        parser.error(f"unknown phase(s) {', '.join(unknown)}; use {', '.join(allowed)}")
    return phases


def dit_kwargs(size: str, task: str = "t2v") -> dict:
    """diffusers ``WanTransformer3DModel`` arguments of a Wan2.1 size ("1.3b" or "14b") and task (:data:`TASKS`)."""
    return {**DIT_COMMON, **DIT_SIZES[size][0], **TASKS[task][0]}


def wan_config(size: str, task: str = "t2v"):
    """fastwan's :class:`~fastwan.models.WanConfig` of a Wan2.1 size and task."""
    from fastwan.models import WanConfig

    return WanConfig.from_dict({"_class_name": "WanTransformer3DModel", **dit_kwargs(size, task)})


TASKS = MappingProxyType({  # checkpoint task -> (DiT kwargs beyond the size's, scheduler shift, A14B boundary)
    "t2v": (MappingProxyType({}), 3.0, None),
    "i2v": (MappingProxyType(dict(in_channels=36, image_dim=1280, added_kv_proj_dim=5120)), 3.0, None),  # 2.1 I2V
    "i2v-a14b": (MappingProxyType(dict(in_channels=36)), 5.0, 0.9),  # Wan2.2-I2V-A14B's two experts
})
CLIP_VIT_H = MappingProxyType(dict(  # the Wan2.1 I2V image encoder's shape (ViT-H/14, 257 tokens of 1280)
    hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16, image_size=224,
    patch_size=14, projection_dim=1024, hidden_act="gelu"))


def make_checkpoint(root: Path, size: str, task: str = "t2v", device: torch.device | str = "cuda",
                    text_encoder_from: Path | None = None) -> None:
    """Random weights at the real shapes of a Wan2.1 ``size`` and ``task`` (:data:`TASKS`), saved as a
    Diffusers-format folder: bf16 DiT and UMT5-XXL, fp32 VAE; "i2v" adds a ViT-H CLIP vision encoder (fp32) and
    its image processor; "i2v-a14b" links ``transformer_2`` to ``transformer`` (the experts load as separate
    tensors, so time and memory are those of two experts). ``text_encoder_from``: another such checkpoint whose
    UMT5-XXL this one links to (saves 11 GB of disk)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from fastwan.checkpoint.tiny import _tokenizer

    root = Path(root)
    if (root / "model_index.json").exists():
        log(f"checkpoint exists at {root}")
        return
    _, shift, boundary = TASKS[task]
    t0 = time.time()
    with torch.device(device):
        torch.manual_seed(0)
        m = WanTransformer3DModel(**dit_kwargs(size, task)).to(torch.bfloat16)
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
        if task == "i2v":
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
    dit = ["diffusers", "WanTransformer3DModel"]
    index = {"_class_name": "WanPipeline" if task == "t2v" else "WanImageToVideoPipeline",
             "_diffusers_version": "0.35.0", "scheduler": ["diffusers", "UniPCMultistepScheduler"],
             "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", "T5TokenizerFast"],
             "transformer": dit, "transformer_2": dit if boundary is not None else [None, None],
             "vae": ["diffusers", "AutoencoderKLWan"], "boundary_ratio": boundary, "expand_timesteps": False}
    if task != "t2v":
        clip = task == "i2v"
        index["image_encoder"] = ["transformers", "CLIPVisionModel"] if clip else [None, None]
        index["image_processor"] = ["transformers", "CLIPImageProcessor"] if clip else [None, None]
    (root / "model_index.json").write_text(json.dumps(index))
    log(f"made random {size} {task} checkpoint in {time.time() - t0:.1f}s")


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


def derive_fastwan(plain: Path, root: Path, seed: int = 0) -> None:
    """A FastWan-layout checkpoint (model_index "WanDMDPipeline", the DiT with VSA gate projections) from a
    text-to-video one made by :func:`make_checkpoint`: every component is a link to ``plain``'s; the transformer
    folder links its weight files and adds ``gates.safetensors`` (random bf16 ``to_gate_compress``, FastVideo's
    names), listed in its shard index (written when the plain checkpoint has a single weight file: a loader reads
    only the files an index names or the ``diffusion_pytorch_model`` ones, never a stray file beside them)."""
    from safetensors.torch import save_file

    plain, root = Path(plain).resolve(), Path(root)
    if not _linked_copy(plain, root, ("transformer", "model_index.json")):
        return
    src, dst = plain / "transformer", root / "transformer"
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".index.json"):
            (dst / f.name).symlink_to(f)
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


def write_lora(path: Path, size: str, rank: int = 64, seed: int = 0) -> None:
    """A random rank-``rank`` LoRA in the original-Wan (lightx2v) layout on every attention and FFN linear of a
    Wan2.1 ``size`` DiT: ``diffusion_model.blocks.N.<module>.lora_down/lora_up.weight`` and ``.alpha``, bf16."""
    from safetensors.torch import save_file

    kw = dit_kwargs(size)
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
    log(f"wrote random rank-{rank} {size} LoRA to {path}")


# ---- DiT variants ------------------------------------------------------------------------------------------

def _named_variants() -> dict[str, dict[str, Any]]:
    """Every name of :func:`option_variants`, before resolution."""
    from fastwan import options

    defaults = DiTOptions()
    named: dict[str, dict[str, Any]] = {"defaults": {}}
    for f in dataclasses.fields(DiTOptions):
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            named[("-" if default else "+") + f.name] = {f.name: not default}
        elif f.name == "block":
            named.update({b: {"block": b} for b in options.BLOCKS if b != default})
    return named


def option_variants(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict[str, dict]:
    """Named :class:`DiTOptions` overrides derived from its fields: "defaults" ({}); each ``block`` other than the
    default by its value ("fast", "reference"); each bool field flipped from its default, "-name" (or "+name").
    A name whose options resolve, for ``device`` and ``dtype``, to those of an earlier name is left out."""
    out, seen = {}, set()
    for label, overrides in _named_variants().items():
        resolved = DiTOptions(**overrides).resolve(device, dtype)
        if resolved not in seen:
            seen.add(resolved)
            out[label] = overrides
    return out


def option_overrides(label: str) -> dict[str, Any]:
    """The DiTOptions overrides named ``label`` (see :func:`option_variants`); ValueError for an unknown name."""
    named = _named_variants()
    if label not in named:
        raise ValueError(f"DiT variant {label!r}: use one of {', '.join(named)}")
    return dict(named[label])


def dit_options(overrides: Mapping[str, Any], device: torch.device | str = "cuda",
                dtype: torch.dtype = torch.bfloat16) -> DiTOptions:
    """``DiTOptions(**overrides)`` (which validates the names and values), resolved for ``device`` and ``dtype``."""
    return DiTOptions(**overrides).resolve(device, dtype)


def build_dit(cfg, attention, state: Mapping[str, torch.Tensor], overrides: Mapping[str, Any] = MappingProxyType({})):
    """A WanTransformer built as ``overrides`` and given the tensors of ``state`` (assigned, not copied: every
    variant built from one state shares its weights), in eval mode without gradients. ``state``'s tensors are on
    CUDA in the model's dtypes (bf16; fp32 where :func:`~fastwan.models.keep_in_fp32`)."""
    from fastwan.models import WanTransformer

    with torch.device("meta"):
        model = WanTransformer(cfg, attention, options=dit_options(overrides))
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)


# ---- the diffusers peers -----------------------------------------------------------------------------------

def tune_diffusers(transformer) -> None:
    """The tuned diffusers peer: its cuDNN attention backend and compile_repeated_blocks(fullgraph=True)."""
    transformer.set_attention_backend("_native_cudnn")
    transformer.compile_repeated_blocks(fullgraph=True)


def diffusers_pipeline(root: Path, tuned: bool):
    """diffusers' WanPipeline from ``root`` on CUDA (bf16, fp32 VAE): the eager peer, or the tuned one
    (:func:`tune_diffusers`)."""
    from diffusers import AutoencoderKLWan, WanPipeline

    vae = AutoencoderKLWan.from_pretrained(Path(root) / "vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(root, vae=vae, torch_dtype=torch.bfloat16).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    if tuned:
        tune_diffusers(pipe.transformer)
    return pipe


# ---- comparing videos ----------------------------------------------------------------------------------------

def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM over frames of two uint8 videos [T, H, W, 3] (luma, 7x7 uniform window, K1=.01, K2=.03)."""
    def luma(v):
        t = torch.from_numpy(v).double()
        return (0.299 * t[..., 0] + 0.587 * t[..., 1] + 0.114 * t[..., 2]).unsqueeze(1)  # [T, 1, H, W]

    x, y = luma(a), luma(b)
    pool = torch.nn.functional.avg_pool2d
    mx, my = pool(x, 7, 1), pool(y, 7, 1)
    vx, vy = pool(x * x, 7, 1) - mx**2, pool(y * y, 7, 1) - my**2
    cxy = pool(x * y, 7, 1) - mx * my
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    m = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(m.mean())


def compare(frames: np.ndarray, ref_path: str | os.PathLike) -> dict | None:
    """PSNR, SSIM and absolute differences of ``frames`` against the video saved at ``ref_path`` (None when there
    is none, or it has another shape)."""
    if not os.path.exists(ref_path):
        return None
    ref = np.load(ref_path)
    if ref.shape != frames.shape:
        return None
    d = np.abs(ref.astype(int) - frames.astype(int))
    return {"psnr_db": psnr(frames, ref), "ssim": ssim(frames, ref), "mean_abs": float(d.mean()),
            "p99_abs": float(np.percentile(d, 99)), "max_abs": int(d.max())}


# ---- kernel time (torch.profiler) --------------------------------------------------------------------------

def classify(name: str) -> str:
    """A DiT kernel's group: attention, gemm, norms or elementwise/other."""
    n = name.lower()
    if n.startswith("triton_"):  # inductor's fused kernels are named after the ops they fuse
        return "norms" if "norm" in n else "elementwise/other"
    if any(s in n for s in ("flash", "fmha", "attention", "sage", "attn", "cudnn_generated")):
        return "attention"
    if any(s in n for s in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "wgmma")):
        return "gemm"
    if any(s in n for s in ("norm", "welford", "rms")):  # incl. fastwan.kernels.norms (norm_rows, rms_rope_rows)
        return "norms"
    return "elementwise/other"


def kernel_times(fn: Callable[[], Any], calls: int = 1, warmup: bool = True) -> dict[str, tuple[float, float]]:
    """{kernel name: (CUDA ms per call of ``fn``, launches per call)} from torch.profiler over ``calls`` calls,
    after one warm-up call unless ``warmup`` is False."""
    from torch.profiler import ProfilerActivity, profile

    if warmup:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ms: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms[e.name] += e.device_time / 1e3
            launches[e.name] += 1
    return {k: (ms[k] / calls, launches[k] / calls) for k in ms}


def kernel_groups(fn: Callable[[], Any], calls: int = 1, group: Callable[[str], str] = classify) -> dict[str, float]:
    """CUDA kernel time per call of ``fn`` (ms) by ``group`` (default :func:`classify`), from
    :func:`kernel_times`."""
    groups: dict[str, float] = defaultdict(float)
    for name, (ms, _) in kernel_times(fn, calls).items():
        groups[group(name)] += ms
    return dict(groups)
