"""What the GPU benchmarks share: logging and versions, timing (CUDA events; the wall clock on the CPU), the device
and its dtype, the Wan inputs and shapes, DiT variants as :class:`~fastwan.options.DiTOptions` overrides, the
diffusers peers, video comparison (PSNR/SSIM), kernel-time grouping (torch.profiler), nvidia-smi sampling, and the
CI sizes: ``--smoke`` and ``--dry-run``. Random checkpoints: :mod:`benchmarks.checkpoints`.

The benchmarks run from the repository root as modules, ``python -m benchmarks.<name>``. An A/B variant is data
(DiTOptions overrides, an attention config, a ``cfg_mode``) that builds its own model or generator; nothing
changes a built one. Every benchmark that RESULTS.md cites runs in CI: at its ``--smoke`` size on the CPU (tiny
random weights and shapes, fp32, one warm-up and one timed run, no peer that needs a GPU), or, where only a GPU
can run it, with ``--dry-run`` (its arguments checked and its jobs listed, nothing run).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
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
    "tiny": (MappingProxyType(dict(num_attention_heads=2, ffn_dim=256, num_layers=2)), (5, 32, 32)),  # --smoke
})
PEERS = MappingProxyType({
    "diffusers": "as installed (eager, default attention), fp32 VAE",
    "diffusers_tuned": "compile_repeated_blocks(fullgraph=True) + _native_cudnn, fp32 VAE",
})


def log(*a) -> None:
    print(*a, flush=True)


def command(prog: str, argv: list[str] | None) -> str:
    """The command line of a run, for its results: ``prog`` and its arguments (``argv``, else the process's)."""
    return " ".join([prog, *(sys.argv[1:] if argv is None else argv)])


def output(path: str | os.PathLike) -> Path:
    """``path`` for a results file, its folder made if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def versions() -> dict:
    import diffusers
    import transformers

    v = {"torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": diffusers.__version__,
         "transformers": transformers.__version__,
         "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
         "cudnn": torch.backends.cudnn.version()}
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        pass
    return v


# ---- timing ----------------------------------------------------------------------------------------------

def cuda_time(fn: Callable[[], Any], warmup: int = 2, iters: int = 5, device: torch.device | str = "cuda") -> float:
    """Median milliseconds of fn() over ``iters`` calls (CUDA events, one synchronised call at a time; the wall
    clock off CUDA), after ``warmup`` calls."""
    return statistics.median(time_fn(fn, warmup=warmup, iters=iters, device=torch.device(device)))


def span_ms(fn: Callable[[], Any], calls: int = 10, rounds: int = 3, device: torch.device | str = "cuda") -> float:
    """Median over ``rounds`` of the ms per call of ``calls`` back-to-back calls (one span, CUDA events)."""
    return statistics.median(span_time(fn, calls=calls, device=torch.device(device)) for _ in range(rounds))


def sync(device: torch.device | str = "cuda") -> None:
    """Wait for ``device``'s queued work (CUDA; nothing to wait for elsewhere)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device | str = "cuda") -> None:
    """Start a new peak of allocated memory on ``device`` (CUDA only: none is tracked elsewhere)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device | str = "cuda") -> float | None:
    """Peak allocated GiB on ``device`` since :func:`reset_peak`; None off CUDA."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if torch.device(device).type == "cuda" else None


def gib(value: float | None) -> str:
    """A peak of :func:`peak_gib` for a table: "12.34", or "-" where none was tracked."""
    return "-" if value is None else f"{value:.2f}"


def bench_dtype(device: torch.device | str) -> torch.dtype:
    """The benchmarks' model dtype on ``device``: bf16 on CUDA (as measured), fp32 on the CPU (--smoke)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


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

def forward_inputs(batch: int, in_ch: int = 16, h: int = H, w: int = W, f: int = F, prompt_tokens: int = TEXT_TOKENS,
                   text_dim: int = TEXT_DIM, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """(latents, timestep, text) of one DiT forward on ``device`` in ``dtype``: latents [batch, in_ch, (f-1)/4+1,
    h/8, w/8], t = 500, and text [batch, 512, text_dim] with the rows after ``prompt_tokens`` zeroed as the
    pipelines pad a prompt."""
    if not 0 <= prompt_tokens <= TEXT_TOKENS:
        raise ValueError(f"prompt_tokens={prompt_tokens} must be 0..{TEXT_TOKENS}")
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(batch, in_ch, (f - 1) // 4 + 1, h // 8, w // 8, device=device, generator=g).to(dtype)
    t = torch.full((batch,), 500.0, device=device)
    text = torch.randn(batch, TEXT_TOKENS, text_dim, device=device, generator=g).to(dtype)
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
    """diffusers ``WanTransformer3DModel`` arguments of a Wan2.1 size (:data:`DIT_SIZES`) and task (:data:`TASKS`);
    a task with image tokens projects them to the model's width."""
    kw = {**DIT_COMMON, **DIT_SIZES[size][0], **TASKS[task][0]}
    if kw.get("image_dim") is not None:
        kw["added_kv_proj_dim"] = kw["num_attention_heads"] * kw["attention_head_dim"]
    return kw


def wan_config(size: str, task: str = "t2v"):
    """fastwan's :class:`~fastwan.models.WanConfig` of a Wan2.1 size and task."""
    from fastwan.models import WanConfig

    return WanConfig.from_dict({"_class_name": "WanTransformer3DModel", **dit_kwargs(size, task)})


TASKS = MappingProxyType({  # checkpoint task -> (DiT kwargs beyond the size's, scheduler shift, A14B boundary)
    "t2v": (MappingProxyType({}), 3.0, None),
    "i2v": (MappingProxyType(dict(in_channels=36, image_dim=1280)), 3.0, None),  # Wan2.1 I2V: 257 CLIP tokens
    "i2v-a14b": (MappingProxyType(dict(in_channels=36)), 5.0, 0.9),  # Wan2.2-I2V-A14B's two experts
})
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


def build_dit(cfg, attention, state: Mapping[str, torch.Tensor], overrides: Mapping[str, Any] = MappingProxyType({}),
              device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """A WanTransformer built as ``overrides`` and given the tensors of ``state`` (assigned, not copied: every
    variant built from one state shares its weights), in eval mode without gradients. ``state``'s tensors are on
    ``device`` in the model's dtypes (``dtype``; fp32 where :func:`~fastwan.models.keep_in_fp32`)."""
    from fastwan.models import WanTransformer

    with torch.device("meta"):
        model = WanTransformer(cfg, attention, options=dit_options(overrides, device, dtype))
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)


# ---- the diffusers peers -----------------------------------------------------------------------------------

def tune_diffusers(transformer) -> None:
    """The tuned diffusers peer: its cuDNN attention backend and compile_repeated_blocks(fullgraph=True)."""
    transformer.set_attention_backend("_native_cudnn")
    transformer.compile_repeated_blocks(fullgraph=True)


def diffusers_pipeline(root: Path, tuned: bool, device: torch.device | str = "cuda"):
    """diffusers' WanPipeline from ``root`` on ``device`` (:func:`bench_dtype`, fp32 VAE): the eager peer, or the
    tuned one (:func:`tune_diffusers`, CUDA only)."""
    from diffusers import AutoencoderKLWan, WanPipeline

    vae = AutoencoderKLWan.from_pretrained(Path(root) / "vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(root, vae=vae, torch_dtype=bench_dtype(device)).to(device)
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


def frames_path(out: Path, key: str) -> Path:
    """Where the run ``key`` (e.g. "i2v-14b:diffusers") keeps its frames, next to the results JSON ``out``."""
    slug = "".join(c if c.isalnum() or c in "-_" else "_" for c in key)
    return out.with_name(f"{out.stem}_{slug}_frames.npy")


def frame_diff(frames: np.ndarray, ref: np.ndarray) -> dict:
    """PSNR, SSIM and absolute differences of the uint8 video ``frames`` against ``ref`` (the same shape)."""
    d = np.abs(ref.astype(int) - frames.astype(int))
    return {"psnr_db": psnr(frames, ref), "ssim": ssim(frames, ref), "mean_abs": float(d.mean()),
            "p99_abs": float(np.percentile(d, 99)), "max_abs": int(d.max())}


def compare(frames: np.ndarray, ref_path: str | os.PathLike) -> dict | None:
    """:func:`frame_diff` of ``frames`` against the video saved at ``ref_path`` (None when there is none, or it has
    another shape)."""
    if not os.path.exists(ref_path):
        return None
    ref = np.load(ref_path)
    if ref.shape != frames.shape:
        return None
    return frame_diff(frames, ref)


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


# ---- the device, and the CI sizes: --smoke and --dry-run ---------------------------------------------------

SMOKE_DIR = Path(tempfile.gettempdir()) / "fastwan-smoke"  # --smoke's tiny checkpoints and outputs by default
SMOKE = "the CI size: tiny random weights and shapes on the CPU in fp32, one warm-up and one timed run, no peer " \
        "that needs a GPU"


def add_device(parser, compile_default: bool | None = None) -> None:
    """``--device`` (default cuda) and, unless ``compile_default`` is None, ``--compile`` / ``--no-compile``
    (torch.compile of the fastwan models)."""
    parser.add_argument("--device", default="cuda", help="torch device (default cuda; --smoke: cpu)")
    if compile_default is not None:
        parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=compile_default,
                            help=f"fastwan: enable_torch_compile (default {'on' if compile_default else 'off'})")


def add_smoke(parser, **settings) -> None:
    """``--smoke``: ``settings`` (argument name -> value) become the defaults (:func:`parse_args`), with
    ``--device cpu --no-compile`` where the parser has those (:func:`add_device`); a flag given explicitly still
    wins."""
    cpu = {name: value for name, value in (("device", "cpu"), ("compile", False))
           if parser.get_default(name) is not None}
    settings = {**cpu, **settings}
    shown = ", ".join(f"{k}={v}" for k, v in settings.items()).replace("%", "%%")
    parser.add_argument("--smoke", action="store_const", const=settings, default=None, help=f"{SMOKE} ({shown})")


def parse_args(parser, argv):
    """``parser.parse_args(argv)``; with ``--smoke`` (:func:`add_smoke`), parsed again with its settings as the
    defaults. ``args.smoke`` is then those settings (truthy), else None."""
    args = parser.parse_args(argv)
    if getattr(args, "smoke", None):
        parser.set_defaults(**args.smoke)
        args = parser.parse_args(argv)
    return args


def device_arg(parser, text: str, *gpu_only: str) -> torch.device:
    """``--device``'s torch device. The parser's error (exit 2, before any work) for a name that is no device, or
    when ``gpu_only`` names something asked for (a phase, a peer, an option) that only a GPU runs, off CUDA."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        parser.error(f"--device {text!r} is not a torch device; use cuda, cuda:N or cpu")
    if device.type != "cuda" and gpu_only:
        parser.error(f"{', '.join(gpu_only)}: only a GPU runs this (--device {text}); leave it out, or run on a "
                     "CUDA device")
    return device


def add_dry_run(parser) -> None:
    """``--dry-run``: check the arguments, list the jobs, run nothing (the CI check of a GPU-only benchmark)."""
    parser.add_argument("--dry-run", action="store_true",
                        help="check the arguments and print the jobs that would be timed, one a line; run nothing "
                             "(no GPU needed)")


def print_plan(name: str, jobs: list) -> int:
    """``--dry-run``'s output: a header, then each job on a line; 0 (the exit status)."""
    log(f"{name} --dry-run: {len(jobs)} job(s), nothing run")
    for job in jobs:
        log(f"  {job}")
    return 0
