"""Wan 14B DiT forward (default 720p x 81 frames, 75,600 tokens, batch 1): diffusers vs fastwan on the same weights.

Random weights at the real 14B shapes are created once on the GPU (diffusers module); every fastwan variant is
built on the meta device and assigned the very same tensors (no copy), so all run identical weights. A variant
is data: '/'-joined parts, each an attention part (FLASH_ATTN's FA4 query tile: auto, t128, t192; nosplit: the
query in one launch), fp8 (the block linears quantized to FP8 from the shared weights), nofold (the text
cross-attention's output projection never folded into its values) or a DiT variant of
:func:`benchmarks.harness.option_variants` (reference, fast), e.g. ``t128/reference`` or ``auto/fp8``. The variants
are timed in interleaved rounds.

``--task`` picks the DiT and its inputs (:mod:`benchmarks.editing_inputs`): t2v, i2v, i2v-a14b; vace (Wan2.1-VACE-14B:
``WanVACETransformer3DModel``, 8 control blocks, control latents of 96 channels; fastwan under ``vace_control``) and
animate (Wan2.2-Animate-14B: ``WanAnimateTransformer3DModel`` at its published config, one 77-frame segment = 21
latent frames with the reference's, the pose latents, a 77-frame 512 x 512 face video and 257 CLIP tokens; fastwan
under ``animate_inputs``, its motion and face encoders run in every forward as diffusers' are). The relative L2
error of each fastwan variant's output against diffusers eager is printed and recorded. The tuned peer compiles
what diffusers' compile_repeated_blocks compiles (its ``_repeated_blocks``, recorded as ``diffusers_tuned_compiled``):
VACE's 40 blocks and 8 control blocks; Animate's 40 blocks only, its motion encoder, face encoder and face adapters
running eager (fastwan's compile_blocks likewise compiles the blocks and control blocks alone).

  python -m benchmarks.forward_14b --backend FLASH_ATTN --compile [--variants auto,t128,reference] [--profile]
  python -m benchmarks.forward_14b --smoke     # CI: a two-block DiT on the CPU, eager peer only

Issue #45 (one H200 each; weights shared by the peers and fastwan, bf16: VACE 17.3 B parameters = 32.3 GiB, Animate
17.3 B = 32.2 GiB; peak about 40 GiB for VACE at 480p, 45 GiB for Animate at 720p; about 3 min for VACE and 5 min for
Animate: 5 eager calls, a compiling call and 4 tuned calls, a compiling call and 6 timed fastwan calls):

  python -m benchmarks.forward_14b --task vace --size 14b --backend FLASH_ATTN --compile --prompt-tokens 100 \
      --iters 3 --rounds 2 --out forward_vace.json          # 480x832x81: 32,760 tokens
  python -m benchmarks.forward_14b --task animate --size 14b --backend FLASH_ATTN --compile --prompt-tokens 100 \
      --iters 3 --rounds 2 --out forward_animate.json       # 720x1280, a 77-frame segment: 75,600 tokens
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.editing_inputs import TASK_CHOICES, default_video, fastwan_config, job_inputs, peer_class, peer_kwargs
from benchmarks.harness import (
    DIT_SIZES, SMOKE_DIR, add_device, add_smoke, bench_dtype, build_dit, command, cuda_time, device_arg, gib,
    kernel_groups, log, option_overrides, output, parse_args, parse_video, peak_gib, raise_recompile_limit, release,
    reset_peak, sync, tune_diffusers, versions)

TILES = {"auto": "auto", "t128": 128, "t192": 192}  # variant part -> FLASH_ATTN fa4_tile_m


def parse_variant(label: str, backend: str) -> tuple[dict | None, dict]:
    """'t128/reference' -> (attention config, DiTOptions overrides); ValueError for an unknown part."""
    tile, split, overrides = "auto", True, {}
    for part in label.split("/"):
        if part == "fp8":  # FP8 block linears (fastwan.models.wan.quantize), quantized from the shared weights
            overrides["fp8"] = True
        elif part == "nofold":  # the prompt cache's fold bound at 0: no prompt is short enough to fold
            overrides["nofold"] = True
        elif part in TILES:
            tile = TILES[part]
        elif part == "nosplit":
            split = False
        else:
            try:
                overrides.update(option_overrides(part))
            except ValueError as exc:
                raise ValueError(f"variant {label!r}: part {part!r} is not {', '.join(TILES)}, nosplit, nofold, "
                                 f"and {exc}") from None
    if backend != "FLASH_ATTN":
        if tile != "auto" or not split:
            raise ValueError(f"variant {label!r}: tile and split parts need --backend FLASH_ATTN")
        return None, overrides
    return {"fa4_tile_m": tile, "fa4_split": split}, overrides


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.forward_14b", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="FLASH_ATTN")
    p.add_argument("--size", default="14b", choices=tuple(DIT_SIZES), help="the DiT's shape (default 14b)")
    add_device(p, compile_default=False)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default="forward_14b.json")
    p.add_argument("--variants", default="auto",
                   help="fastwan setups timed in interleaved rounds, comma-separated; each '/'-joined parts: "
                        "auto|t128|t192 (FLASH_ATTN's fa4_tile_m), nosplit (FA4's query in one launch), nofold (no "
                        "folded text projection), or a DiT variant (defaults, reference, fast)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-tuned-peer", dest="tuned_peer", action="store_false",
                   help="skip the second peer (diffusers with compile_repeated_blocks and _native_cudnn)")
    p.add_argument("--profile", action="store_true", help="also a kernel-time breakdown per variant")
    p.add_argument("--video", default=None, metavar="HxWxF",
                   help="height x width x frames (animate: the segment's frames); default: the task's job, vace "
                        "480x832x81, animate 720x1280x77, the others 720x1280x81")
    p.add_argument("--batch", type=int, default=1, help="samples per forward (2: a batched CFG pass)")
    p.add_argument("--task", default="t2v", choices=TASK_CHOICES,
                   help="the DiT's task (benchmarks.editing_inputs): i2v-a14b reads 36 input channels (a "
                        "Wan2.2-I2V-A14B expert), i2v also 257 CLIP image tokens (Wan2.1-I2V-14B), vace control "
                        "latents (Wan2.1-VACE-14B), animate pose latents, a face video and CLIP tokens "
                        "(Wan2.2-Animate-14B)")
    p.add_argument("--prompt-tokens", type=int, default=512,
                   help="text rows kept; the rest are zeroed as the pipelines pad a prompt (512: random text, no "
                        "padding)")
    add_smoke(p, size="tiny", backend="TORCH_SDPA", video="32x32x5", iters=1, rounds=1, tuned_peer=False,
              prompt_tokens=20, variants="auto,fast,auto/fp8", out=str(SMOKE_DIR / "forward_14b.json"))
    return p


def compiled_regions(model) -> dict[str, int]:
    """The modules compile_repeated_blocks compiles in diffusers' ``model`` (its ``_repeated_blocks`` classes), by
    class: count; the rest of the model runs eager."""
    names = [type(m).__name__ for m in model.modules() if type(m).__name__ in (model._repeated_blocks or ())]
    return {name: names.count(name) for name in dict.fromkeys(names)}


def compiled_text(regions: dict[str, int]) -> str:
    return (", ".join(f"{n} {name}" for name, n in regions.items()) or "nothing") + "; the rest runs eager"


def diffusers_peers(ref, args, a, res: dict, kw: dict) -> torch.Tensor:
    """Time diffusers' model (eager, then tuned unless --no-tuned-peer) into ``res``; the eager output."""
    reset_peak(a.device)
    res["diffusers_ms"] = cuda_time(lambda: ref(*args, **kw, return_dict=False), warmup=1, iters=a.iters,
                                    device=a.device)
    res["diffusers_peak_gib"] = peak_gib(a.device)
    want = ref(*args, **kw, return_dict=False)[0].float()
    log(f"diffusers {a.size} forward: {res['diffusers_ms']:.0f} ms, peak {gib(res['diffusers_peak_gib'])} GiB")
    if a.tuned_peer:  # the second peer, on the same module and weights: diffusers tuned
        tune_diffusers(ref)
        res["diffusers_tuned_compiled"] = compiled_regions(ref)
        log(f"diffusers tuned: compile_repeated_blocks compiles {compiled_text(res['diffusers_tuned_compiled'])}")
        t0 = time.perf_counter()
        ref(*args, **kw, return_dict=False)
        torch.cuda.synchronize()
        res["diffusers_tuned_first_call_s"] = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        res["diffusers_tuned_ms"] = cuda_time(lambda: ref(*args, **kw, return_dict=False), warmup=0, iters=a.iters)
        res["diffusers_tuned_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        got = ref(*args, **kw, return_dict=False)[0].float()
        res["diffusers_tuned_rel_err_vs_eager"] = ((got - want).norm() / want.norm()).item()
        log(f"diffusers tuned 14B forward: {res['diffusers_tuned_ms']:.0f} ms, "
            f"peak {res['diffusers_tuned_peak_gib']:.1f} GiB")
    return want


@torch.no_grad()
def main(argv=None) -> int:
    p = build_parser()
    a = parse_args(p, argv)
    device = device_arg(p, a.device, *(["the tuned peer (--no-tuned-peer leaves it out)"] if a.tuned_peer else []),
                        *(["--profile"] if a.profile else []))
    dtype = bench_dtype(device)
    try:
        if not 0 <= a.prompt_tokens <= 512:
            raise ValueError(f"--prompt-tokens {a.prompt_tokens}: must be 0..512")
        h, w, f = parse_video(a.video or default_video(a.task))
        if a.batch < 1:
            raise ValueError(f"--batch {a.batch}: must be at least 1")
        variants = {label: parse_variant(label, a.backend) for label in a.variants.split(",")}
    except ValueError as exc:
        p.error(str(exc))
    from fastwan.attention import AttentionDispatch
    from fastwan.models import keep_in_fp32
    from fastwan.models.wan.quantize import fp8_layer_names, use_fp8

    with torch.device(device):
        torch.manual_seed(0)
        ref = peer_class(a.task)(**peer_kwargs(a.size, a.task)).to(dtype).eval()
    for name, prm in ref.named_parameters():  # the modules diffusers keeps in fp32
        if keep_in_fp32(name):
            prm.data = prm.data.float()
    args, cond = job_inputs(a.task, ref.config, a.batch, h, w, f, a.prompt_tokens, device, dtype)
    frames, lh, lw = args[0].shape[2:]
    res = {"versions": versions(), "command": command(p.prog, argv), "size": a.size,
           "tokens": frames * (lh // 2) * (lw // 2), "video": [h, w, f], "batch": a.batch,
           "prompt_tokens": a.prompt_tokens, "task": a.task, "dit": type(ref).__name__, "inputs": cond.shapes,
           "parameters_b": sum(t.numel() for t in ref.parameters()) / 1e9}
    raise_recompile_limit()  # the peers' compiled blocks too: a VACE DiT's first control block differs from the rest
    want = diffusers_peers(ref, args, a, res, cond.peer)

    state = ref.state_dict()
    ref = None
    release(False, device)
    cfg = fastwan_config(a.size, a.task)
    models = {}
    for label, (conf, overrides) in variants.items():
        att = AttentionDispatch.resolve(a.backend, device=device, dtype=dtype, head_dim=128, config=conf)
        options = {k: v for k, v in overrides.items() if k not in ("fp8", "nofold")}
        model = build_dit(cfg, att, state, options, device, dtype)  # the same tensors as diffusers' model: no copy
        if overrides.get("nofold"):
            if model.prompts is None:
                raise SystemExit(f"variant {label!r}: nofold needs the fast block (it has the prompt cache)")
            model.prompts.fold_max_width = 0.0
        if overrides.get("fp8"):
            use_fp8(model, fp8_layer_names(model), device=device, dtype=dtype)
        if a.compile:
            model.compile_blocks(fullgraph=True)
        t0 = time.perf_counter()
        got = cond.run(model, args).float()
        sync(device)
        key = f"{label}: {att.describe(device)}{', compiled' if a.compile else ''}"
        e = res.setdefault("fastwan", {})[label] = {"setup": key, "overrides": overrides,
                                                     "first_call_s": time.perf_counter() - t0,
                                                     "rel_err_vs_diffusers": ((got - want).norm() / want.norm()).item()}
        log(f"{key}: first call {e['first_call_s']:.1f} s, rel err {e['rel_err_vs_diffusers']:.2e}")
        del got
        models[label] = model
    del want
    times = {label: [] for label in models}
    reset_peak(device)
    for r in range(a.rounds):  # interleaved, so clock/thermal drift hits every variant alike
        for label, model in models.items():
            times[label].append(cuda_time(lambda m=model: cond.run(m, args), warmup=0, iters=a.iters,
                                          device=device))
        log(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f} ms" for k, v in times.items()))
    res["fastwan_peak_gib"] = peak_gib(device)
    for label, model in models.items():
        e = res["fastwan"][label]
        e["ms"] = statistics.median(times[label])
        e["rounds_ms"] = times[label]
        e["speedup"] = res["diffusers_ms"] / e["ms"]
        if a.tuned_peer:
            e["speedup_vs_tuned"] = res["diffusers_tuned_ms"] / e["ms"]
        if a.profile:
            e["kernel_ms"] = kernel_groups(lambda m=model: cond.run(m, args))
    print(f"\ndiffusers: {res['diffusers_ms']:.0f} ms (peak {gib(res['diffusers_peak_gib'])} GiB)")
    if a.tuned_peer:
        print(f"diffusers tuned: {res['diffusers_tuned_ms']:.0f} ms (peak {res['diffusers_tuned_peak_gib']:.1f} GiB; "
              f"compiled: {compiled_text(res['diffusers_tuned_compiled'])})")
    for e in res["fastwan"].values():
        groups = ", ".join(f"{k} {v:.0f}" for k, v in e.get("kernel_ms", {}).items())
        tuned = f", {e['speedup_vs_tuned']:.3f}x tuned" if a.tuned_peer else ""
        print(f"{e['setup']}: {e['ms']:.0f} ms ({e['speedup']:.3f}x eager{tuned}, "
              f"rel err {e['rel_err_vs_diffusers']:.2e})" + (f" kernels: {groups}" if groups else ""))
    output(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
