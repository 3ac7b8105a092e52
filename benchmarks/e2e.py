"""End-to-end and DiT-forward benchmark: fastwan vs diffusers on the same random weights (GPU).

Phases (run them in one process or separately; each appends to the JSON given by --out):
  make       write a random checkpoint at the real Wan2.1-1.3B shapes (DiT, UMT5-XXL, Wan VAE) to --ckpt
  forward    DiT forward ms at batch 1 and 2: diffusers (SDPA default) and fastwan per --backends
  diffusers  WanPipeline end to end (--steps, CFG --guidance), frames saved for the comparison
  diffusers_tuned  the same with compile_repeated_blocks(fullgraph=True) and the _native_cudnn attention backend
  fastwan    VideoGenerator end to end (--backend, --cfg-mode), frames compared with the diffusers run
Random weights have the FLOPs and kernels of the real model; image quality is not measured here.

  python benchmarks/e2e.py --phase make,forward,diffusers,diffusers_tuned,fastwan --compile --out results.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

H, W, F = 480, 832, 81
PROMPT = "a red fox running through fresh snow in a pine forest, cinematic lighting"
NEG = "blurry, low quality, static"


def log(*a):
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


def make_checkpoint(root: Path, size: str) -> None:
    """Random weights at the real shapes, saved as a Diffusers-format folder (bf16 DiT/UMT5, fp32 VAE)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from fastwan.tiny import _tokenizer

    if (root / "model_index.json").exists():
        log(f"checkpoint exists at {root}")
        return
    t0 = time.time()
    dit = dict(num_attention_heads=12, ffn_dim=8960, num_layers=30) if size == "1.3b" else \
        dict(num_attention_heads=40, ffn_dim=13824, num_layers=40)
    with torch.device("cuda"):
        torch.manual_seed(0)
        m = WanTransformer3DModel(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16,
                                  text_dim=4096, freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                  eps=1e-6, rope_max_seq_len=1024, **dit).to(torch.bfloat16)
        m.save_pretrained(root / "transformer", safe_serialization=True, max_shard_size="10GB")
        del m
        cfg = UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                         feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                         relative_attention_max_distance=128, dense_act_fn="gelu_new", is_gated_act=True,
                         tie_word_embeddings=False)
        te = UMT5EncoderModel(cfg).to(torch.bfloat16)
        te.save_pretrained(root / "text_encoder", safe_serialization=True, max_shard_size="10GB")
        del te
        AutoencoderKLWan().save_pretrained(root / "vae", safe_serialization=True)
    torch.cuda.empty_cache()
    _tokenizer().save_pretrained(root / "tokenizer")
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                            num_train_timesteps=1000).save_pretrained(root / "scheduler")
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "_diffusers_version": "0.35.0",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None], "vae": ["diffusers", "AutoencoderKLWan"], "boundary_ratio": None,
        "expand_timesteps": False}))
    log(f"made random {size} checkpoint in {time.time() - t0:.1f}s")


def cuda_time(fn, warmup=2, iters=5) -> float:
    """Median milliseconds of fn() over iters runs (CUDA events), after warmup runs."""
    from fastwan.profiler.core import time_fn

    return statistics.median(time_fn(fn, warmup=warmup, iters=iters, device=torch.device("cuda")))


def forward_inputs(batch: int, in_ch=16, h=H, w=W, f=F):
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(batch, in_ch, (f - 1) // 4 + 1, h // 8, w // 8, device="cuda", generator=g).to(torch.bfloat16)
    t = torch.full((batch,), 500.0, device="cuda")
    text = torch.randn(batch, 512, 4096, device="cuda", generator=g).to(torch.bfloat16)
    return x, t, text


def parse_backend(label: str) -> tuple[str, dict | None]:
    """'TORCH_SDPA[cudnn]' -> ('TORCH_SDPA', {'kernel': 'cudnn'}); 'FLASH_ATTN[4]' -> version 4."""
    if "[" not in label:
        return label, None
    name, arg = label[:-1].split("[")
    return name, ({"version": int(arg)} if name == "FLASH_ATTN" else {"kernel": arg})


def attention_kernel_ms(fn) -> float:
    """CUDA time (ms) of the attention kernels in one call of fn, from torch.profiler."""
    from profile_forward import kernel_groups

    return kernel_groups(fn).get("attention", 0.0)


@torch.no_grad()
def phase_forward(root: Path, backends: list[str], res: dict, iters: int, compile_: bool = False) -> None:
    from diffusers import WanTransformer3DModel

    from fastwan.attention import AttentionDispatch
    from fastwan.models import load_transformer

    out = res.setdefault("forward_ms", {})
    ref = WanTransformer3DModel.from_pretrained(root / "transformer", torch_dtype=torch.bfloat16).cuda().eval()
    for b in (1, 2):
        args = forward_inputs(b)
        out[f"diffusers_b{b}"] = cuda_time(lambda args=args: ref(*args, return_dict=False), iters=iters)
        log(f"diffusers forward B={b}: {out[f'diffusers_b{b}']:.1f} ms")
    x, t, text = forward_inputs(1)
    want = ref(x, t, text, return_dict=False)[0].float()
    ref = None
    torch.cuda.empty_cache()
    model = None
    attn_flops = 4 * 12 * (21 * 30 * 52) ** 2 * 128 * 30  # per batch element, 30 layers
    for label in backends:
        key = label + (" compiled" if compile_ else "")
        try:
            name, conf = parse_backend(label)
            att = AttentionDispatch.resolve(name, device="cuda", dtype=torch.bfloat16, head_dim=128, config=conf)
            if model is None:
                model = load_transformer(root / "transformer", dtype=torch.bfloat16, device="cuda", attention=att)
                if compile_:
                    for blk in model.blocks:
                        blk.compile(fullgraph=True)
            model.set_attention(att)
            if compile_:
                torch._dynamo.reset()
            got = model(x, t, text).float()
            rel = ((got - want).norm() / want.norm()).item()
            out[f"{key}_kernel"] = att.describe("cuda")
            out[f"{key}_rel_err_vs_diffusers"] = rel
            ams = attention_kernel_ms(lambda m=model: m(x, t, text))
            out[f"{key}_attention_ms_b1"] = ams
            out[f"{key}_attention_tflops_in_model"] = attn_flops / (ams * 1e-3) / 1e12
            for b in (1, 2):
                args = forward_inputs(b)
                out[f"{key}_b{b}"] = cuda_time(lambda args=args, m=model: m(*args), iters=iters)
            log(f"fastwan[{key}] forward B=1 {out[f'{key}_b1']:.1f} ms, B=2 {out[f'{key}_b2']:.1f} ms, attention "
                f"in model {ams:.1f} ms = {out[f'{key}_attention_tflops_in_model']:.0f} TFLOP/s, rel err {rel:.2e}")
        except Exception as exc:  # keep going: report the failure
            out[f"{key}_error"] = f"{type(exc).__name__}: {exc}"
            log(f"fastwan[{key}] FAILED: {exc}")
    model = None
    torch.cuda.empty_cache()


def tune_diffusers(transformer) -> None:
    """The tuned diffusers peer: its cuDNN attention backend and compile_repeated_blocks(fullgraph=True)."""
    transformer.set_attention_backend("_native_cudnn")
    transformer.compile_repeated_blocks(fullgraph=True)


def phase_diffusers(root: Path, steps: int, guidance: float, res: dict, tuned: bool = False) -> None:
    """diffusers' WanPipeline end to end (fp32 VAE), as installed (eager) or tuned (:func:`tune_diffusers`)."""
    from diffusers import AutoencoderKLWan, WanPipeline

    vae = AutoencoderKLWan.from_pretrained(root / "vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(root, vae=vae, torch_dtype=torch.bfloat16).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    if tuned:
        tune_diffusers(pipe.transformer)
    t0 = time.perf_counter()
    pipe(PROMPT, negative_prompt=NEG, height=H, width=W, num_frames=F, num_inference_steps=2 if tuned else 1,
         guidance_scale=guidance, output_type="latent")  # warm-up (handles; compilation when tuned), not timed
    warmup = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = pipe(PROMPT, negative_prompt=NEG, height=H, width=W, num_frames=F, num_inference_steps=steps,
               guidance_scale=guidance, generator=torch.Generator("cuda").manual_seed(0), output_type="np").frames[0]
    torch.cuda.synchronize()
    e2e = time.perf_counter() - t0
    frames = (out * 255).round().astype(np.uint8)
    key = "diffusers_tuned_e2e" if tuned else "diffusers_e2e"
    res[key] = {"seconds": e2e, "steps": steps, "s_per_step": e2e / steps, "warmup_s": warmup,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "setup": "compile_repeated_blocks(fullgraph=True) + _native_cudnn, fp32 VAE" if tuned
                else "as installed (eager, default attention), fp32 VAE"}
    if tuned:
        res[key]["vs_diffusers"] = compare(frames, "/tmp/diffusers_frames.npy")
    else:
        np.save("/tmp/diffusers_frames.npy", frames)
    log(f"{key} {e2e:.2f}s, peak {res[key]['peak_gib']:.2f} GiB")
    del pipe, vae
    if tuned:
        torch._dynamo.reset()
    torch.cuda.empty_cache()


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


def compare(frames: np.ndarray, ref_path: str) -> dict | None:
    if not os.path.exists(ref_path):
        return None
    ref = np.load(ref_path)
    if ref.shape != frames.shape:
        return None
    d = np.abs(ref.astype(int) - frames.astype(int))
    return {"psnr_db": psnr(frames, ref), "ssim": ssim(frames, ref), "mean_abs": float(d.mean()),
            "p99_abs": float(np.percentile(d, 99)), "max_abs": int(d.max())}


def phase_fastwan(root: Path, steps: int, guidance: float, backend: str, cfg_mode: str, compile_: bool,
                  res: dict, attention_config: dict | None = None, tag: str | None = None) -> None:
    from fastwan import VideoGenerator

    gen = VideoGenerator.from_pretrained(root, device="cuda", dtype=torch.bfloat16, attention_backend=backend,
                                         attention_config=attention_config, cfg_mode=cfg_mode,
                                         enable_torch_compile=compile_)
    tag = tag or backend
    key = f"fastwan_e2e[{tag},{cfg_mode}{',compiled' if compile_ else ''}]"
    kw = dict(negative_prompt=NEG, height=H, width=W, num_frames=F, num_inference_steps=steps,
              guidance_scale=guidance, seed=0, save_video=False)
    t0 = time.perf_counter()  # warm-up: kernel JIT (FA4) and, with --compile, compilation; not timed
    gen.generate_video(PROMPT, **{**kw, "num_inference_steps": 2})
    res[key + "_warmup_s"] = time.perf_counter() - t0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = gen.generate_video(PROMPT, **kw)
    torch.cuda.synchronize()
    e2e = time.perf_counter() - t0
    entry = {"seconds": e2e, "steps": steps, "s_per_step": r.timings["denoising"] / steps, "timings": r.timings,
             "peak_gib": r.peak_memory / 2**30, "attention": r.attention_backend, "config": attention_config,
             "vs_diffusers": compare(r.frames, "/tmp/diffusers_frames.npy")}
    if attention_config is None and not compile_:
        np.save("/tmp/frames_dense.npy", r.frames)
    else:
        entry["vs_fastwan_dense_eager"] = compare(r.frames, "/tmp/frames_dense.npy")
    res[key] = entry
    log(f"{key}: {e2e:.2f}s ({entry['s_per_step']:.3f} s/step), peak {entry['peak_gib']:.2f} GiB, "
        f"vs diffusers {entry['vs_diffusers']}, vs dense {entry.get('vs_fastwan_dense_eager')}")
    del gen
    if compile_:  # compiled blocks stay referenced by dynamo's cache (keeping the weights alive) until reset
        torch._dynamo.reset()
    torch.cuda.empty_cache()


def unshared_cfg(model):
    """A forward_cfg that runs the two CFG passes in full (the pre-sharing loop), for A/B runs."""
    def forward_cfg(x, ts, cond, uncond, *, batched=True, **kw):
        if batched:
            return model(torch.cat([x, x]), ts.expand(2, *ts.shape[1:]), torch.cat([cond, uncond]), **kw).chunk(2)
        return model(x, ts, cond, **kw), model(x, ts, uncond, **kw)
    return forward_cfg


def phase_cfg_ab(root: Path, steps: int, guidance: float, backend: str, repeats: int, res: dict,
                 compile_: bool = False, modes: tuple[str, ...] = ("sequential", "batched")) -> None:
    """CFG variants, interleaved runs on one generator (same weights, same process). A mode is batched or
    sequential, optionally "-unshared" (both passes in full, without forward_cfg's shared start) and/or "-nogr"
    (without the residual adds in the output GEMMs, WanTransformer.set_fast_paths(gemm_residual=False)) and/or
    "-nocollapse" (the cross-attention over all 512 text tokens, set_fast_paths(text_collapse=False)) and/or
    "-nosplit" (FLASH_ATTN's FA4 query in one launch, fa4_split=False) and/or "-nofold" (the cross-attention's
    output projection not folded into the text values, set_fast_paths(text_fold=False))."""
    import torch._dynamo.config as dcfg

    from fastwan import VideoGenerator

    for name in ("recompile_limit", "cache_size_limit"):  # the modes' switches are guards of the same block code
        if hasattr(dcfg, name):
            setattr(dcfg, name, max(getattr(dcfg, name), 64))
    gen = VideoGenerator.from_pretrained(root, device="cuda", dtype=torch.bfloat16, attention_backend=backend,
                                         enable_torch_compile=compile_)
    kw = dict(negative_prompt=NEG, height=H, width=W, num_frames=F, num_inference_steps=steps,
              guidance_scale=guidance, seed=0, save_video=False)

    def run(mode, gen=gen, **extra):
        gen.cfg_mode = mode.split("-")[0]
        for m in gen.transformers:
            m.set_fast_paths(gemm_residual="-nogr" not in mode, text_collapse="-nocollapse" not in mode,
                             text_fold="-nofold" not in mode)
        for b in (gen.attention.self_backend, gen.attention.cross_backend):
            if hasattr(b, "fa4_split"):  # FLASH_ATTN: FA4's query in two launches of whole waves where they pay
                b.fa4_split = "-nosplit" not in mode
            if "-unshared" in mode:
                m.forward_cfg = unshared_cfg(m)
            elif "forward_cfg" in m.__dict__:
                del m.forward_cfg
        return gen.generate_video(PROMPT, **{**kw, **extra})

    for mode in modes:  # warm-up (FA4 JIT; with --compile, a graph per batch size)
        run(mode, num_inference_steps=2)
    per_step: dict[str, list[float]] = {m: [] for m in modes}
    peaks: dict[str, float] = {}
    frames: dict[str, np.ndarray] = {}
    for _ in range(repeats):
        for mode in modes:
            r = run(mode)
            per_step[mode].append(r.timings["denoising"] / steps)
            peaks[mode] = r.peak_memory / 2**30
            frames[mode] = r.frames
    first = modes[0]
    out = {m: {"s_per_step_runs": v, "s_per_step_median": statistics.median(v), "spread": max(v) - min(v),
               "peak_gib": peaks[m], f"max_abs_vs_{first}": int(np.abs(frames[m].astype(int)
                                                                       - frames[first].astype(int)).max())}
           for m, v in per_step.items()}
    res[f"cfg_ab[{backend},{steps} steps,x{repeats}{',compiled' if compile_ else ''}]"] = out
    for m, o in out.items():
        log(f"cfg {m}: median {o['s_per_step_median']:.4f} s/step (runs {[round(x, 4) for x in o['s_per_step_runs']]}),"
            f" peak {o['peak_gib']:.2f} GiB, max |frames - {first}| {o[f'max_abs_vs_{first}']}")
    del run, gen
    if compile_:
        torch._dynamo.reset()
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", default="make,forward,diffusers,fastwan")
    p.add_argument("--ckpt", default="/tmp/wan13b-random")
    p.add_argument("--size", default="1.3b", choices=("1.3b", "14b"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--backends", default="TORCH_SDPA[flash],TORCH_SDPA[cudnn],FLASH_ATTN,SAGE_ATTN")
    p.add_argument("--backend", default="FLASH_ATTN")
    p.add_argument("--cfg-modes", default="auto", help="fastwan phase: cfg_mode values, comma-separated")
    p.add_argument("--cfg-ab-modes", default="sequential,batched",
                   help="cfgab phase: batched|sequential, each optionally with -unshared (no shared start) "
                        "and/or -nogr (no residual adds in the output GEMMs) and/or -nocollapse (cross-attention "
                        "over all 512 text tokens) and/or -nosplit (FA4's query in one launch) and/or -nofold (no "
                        "folded cross-attention output projection)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sparse-variants", default="sta-auto-fa4,vsa-auto-fa4,gna-auto-fa4")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default="e2e.json")
    a = p.parse_args(argv)
    root = Path(a.ckpt)
    res = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    res.setdefault("versions", versions())
    res.setdefault("commands", []).append(" ".join(["python"] + sys.argv))
    for ph in a.phase.split(","):
        if ph == "make":
            make_checkpoint(root, a.size)
        elif ph == "forward":
            phase_forward(root, a.backends.split(","), res, a.iters, a.compile)
        elif ph == "diffusers":
            phase_diffusers(root, a.steps, a.guidance, res)
        elif ph == "diffusers_tuned":
            phase_diffusers(root, a.steps, a.guidance, res, tuned=True)
        elif ph == "sparse":  # configs at ~85% sparsity, chosen as in benchmarks/sparse_bench.py
            from sparse_bench import variants

            chosen = {v[0]: v for v in variants((21, 30, 52))}
            for label in a.sparse_variants.split(","):
                _, name, conf, _ = chosen[label]
                phase_fastwan(root, a.steps, a.guidance, name, "batched", a.compile, res, attention_config=conf,
                              tag=label)
        elif ph == "cfgab":
            phase_cfg_ab(root, a.steps, a.guidance, a.backend, a.repeats, res, a.compile,
                         tuple(a.cfg_ab_modes.split(",")))
        elif ph == "fastwan":
            for mode in a.cfg_modes.split(","):
                phase_fastwan(root, a.steps, a.guidance, a.backend, mode, a.compile, res)
        else:
            raise SystemExit(f"unknown phase {ph!r}")
        Path(a.out).write_text(json.dumps(res, indent=1))
    log(json.dumps(res, indent=1))
    summary(res)
    return 0


def summary(res: dict) -> None:
    """The end-to-end figures of this run as a short table: each fastwan run against both diffusers peers."""
    peers = {k: res[k]["seconds"] for k in ("diffusers_e2e", "diffusers_tuned_e2e") if k in res}
    rows = [(k, v["seconds"], v["peak_gib"]) for k, v in res.items() if k.startswith(("diffusers_e2e",
                                                                                      "diffusers_tuned_e2e"))]
    rows += [(k, v["seconds"], v["peak_gib"]) for k, v in res.items()
             if k.startswith("fastwan_e2e[") and isinstance(v, dict)]
    log("\n| run | seconds | peak GiB | " + " | ".join(f"vs {p}" for p in peers) + " |")
    for name, sec, peak in rows:
        log(f"| {name} | {sec:.2f} | {peak:.2f} | " + " | ".join(f"{p / sec:.3f}x" for p in peers.values()) + " |")


if __name__ == "__main__":
    sys.exit(main())
