"""Wan 14B DiT forward at 720p x 81 frames (75,600 tokens), batch 1: diffusers vs fastwan on the same weights.

Random weights at the real 14B shapes are created once on the GPU (diffusers module); fastwan's DiT is built
on the meta device and assigned the very same tensors (no copy), so both run identical weights.

  python benchmarks/forward_14b.py --backend FLASH_ATTN --compile [--variants t128+nofn,auto] [--profile]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e import cuda_time, forward_inputs, tune_diffusers, versions  # noqa: E402


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="FLASH_ATTN")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default="forward_14b.json")
    p.add_argument("--variants", default="auto",
                   help="fastwan setups timed in interleaved rounds: auto|t128|t192 (FLASH_ATTN's fa4_tile_m), "
                        "+nofn for the Inductor norms instead of the fused Triton ones, +nogr without the residual "
                        "adds in the output GEMMs, +nocollapse with the cross-attention over all 512 text tokens, "
                        "+nosplit with FA4's query in one launch, +nofold without the cross-attention's output "
                        "projection folded into the text values")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-tuned-peer", dest="tuned_peer", action="store_false",
                   help="skip the second peer (diffusers with compile_repeated_blocks and _native_cudnn)")
    p.add_argument("--profile", action="store_true", help="also a kernel-time breakdown per variant")
    p.add_argument("--prompt-tokens", type=int, default=512,
                   help="text rows kept; the rest are zeroed as the pipelines pad a prompt (512: random text, no "
                        "padding)")
    a = p.parse_args()
    from diffusers import WanTransformer3DModel

    from fastwan.attention import AttentionDispatch
    from fastwan.models import WanConfig, WanTransformer, keep_in_fp32

    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
               out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
    with torch.device("cuda"):
        torch.manual_seed(0)
        ref = WanTransformer3DModel(**cfg).to(torch.bfloat16).eval()
    for name, prm in ref.named_parameters():  # the modules diffusers keeps in fp32
        if keep_in_fp32(name):
            prm.data = prm.data.float()
    res = {"versions": versions(), "command": " ".join(["python"] + sys.argv), "tokens": 21 * 45 * 80}
    args = forward_inputs(1, h=720, w=1280)
    if not 0 <= a.prompt_tokens <= 512:
        raise SystemExit(f"--prompt-tokens {a.prompt_tokens}: must be 0..512")
    args[2][:, a.prompt_tokens:] = 0  # the padding of a short prompt (diffusers' and fastwan's pipelines)
    res["prompt_tokens"] = a.prompt_tokens
    torch.cuda.reset_peak_memory_stats()
    res["diffusers_ms"] = cuda_time(lambda: ref(*args, return_dict=False), warmup=1, iters=a.iters)
    res["diffusers_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    want = ref(*args, return_dict=False)[0].float()
    print(f"diffusers 14B forward: {res['diffusers_ms']:.0f} ms, peak {res['diffusers_peak_gib']:.1f} GiB", flush=True)
    if a.tuned_peer:  # the second peer, on the same module and weights: diffusers tuned
        tune_diffusers(ref)
        t0 = time.perf_counter()
        ref(*args, return_dict=False)
        torch.cuda.synchronize()
        res["diffusers_tuned_first_call_s"] = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        res["diffusers_tuned_ms"] = cuda_time(lambda: ref(*args, return_dict=False), warmup=0, iters=a.iters)
        res["diffusers_tuned_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        got = ref(*args, return_dict=False)[0].float()
        res["diffusers_tuned_rel_err_vs_eager"] = ((got - want).norm() / want.norm()).item()
        del got
        print(f"diffusers tuned 14B forward: {res['diffusers_tuned_ms']:.0f} ms, "
              f"peak {res['diffusers_tuned_peak_gib']:.1f} GiB", flush=True)

    import torch._dynamo.config as dcfg

    for name in ("recompile_limit", "cache_size_limit"):  # every variant compiles the same block code object
        if hasattr(dcfg, name):
            setattr(dcfg, name, max(getattr(dcfg, name), 64))
    state = ref.state_dict()
    ref = None
    torch.cuda.empty_cache()
    models = {}
    for label in a.variants.split(","):
        tile, _, norms = label.partition("+")
        if tile not in ("auto", "t128", "t192") or norms not in ("", "nofn", "nogr", "nocollapse", "nosplit",
                                                                    "nofold"):
            raise SystemExit(f"variant {label!r}: use auto, t128 or t192, optionally +nofn, +nogr, +nocollapse "
                             "or +nosplit or +nofold")
        conf = {"fa4_tile_m": "auto" if tile == "auto" else int(tile.lstrip("t")),
                "fa4_split": norms != "nosplit"} if a.backend == "FLASH_ATTN" else None
        att = AttentionDispatch.resolve(a.backend, device="cuda", dtype=torch.bfloat16, head_dim=128, config=conf)
        with torch.device("meta"):
            model = WanTransformer(WanConfig.from_dict({"_class_name": "WanTransformer3DModel", **cfg}), att)
        model.load_state_dict(state, assign=True, strict=True)  # the same tensors as diffusers' model: no copy
        model.eval()
        model.set_fast_paths(fused_norms=norms != "nofn", gemm_residual=norms != "nogr",
                             text_collapse=norms != "nocollapse", text_fold=norms != "nofold")
        if a.compile:
            for blk in model.blocks:
                blk.compile(fullgraph=True)
        t0 = time.perf_counter()
        got = model(*args).float()
        torch.cuda.synchronize()
        key = f"{label}: {att.describe('cuda')}{', compiled' if a.compile else ''}"
        e = res.setdefault("fastwan", {})[label] = {"setup": key, "first_call_s": time.perf_counter() - t0,
                                                     "rel_err_vs_diffusers": ((got - want).norm() / want.norm()).item()}
        print(f"{key}: first call {e['first_call_s']:.1f} s, rel err {e['rel_err_vs_diffusers']:.2e}", flush=True)
        del got
        models[label] = model
    del want
    times = {label: [] for label in models}
    torch.cuda.reset_peak_memory_stats()
    for r in range(a.rounds):  # interleaved, so clock/thermal drift hits every variant alike
        for label, model in models.items():
            times[label].append(cuda_time(lambda m=model: m(*args), warmup=0, iters=a.iters))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f} ms" for k, v in times.items()), flush=True)
    res["fastwan_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    for label, model in models.items():
        e = res["fastwan"][label]
        e["ms"] = statistics.median(times[label])
        e["rounds_ms"] = times[label]
        e["speedup"] = res["diffusers_ms"] / e["ms"]
        if a.profile:
            from profile_forward import kernel_groups

            e["kernel_ms"] = kernel_groups(lambda m=model: m(*args))
    if a.tuned_peer:
        for e in res["fastwan"].values():
            e["speedup_vs_tuned"] = res["diffusers_tuned_ms"] / e["ms"]
    print(f"\ndiffusers: {res['diffusers_ms']:.0f} ms (peak {res['diffusers_peak_gib']:.1f} GiB)")
    if a.tuned_peer:
        print(f"diffusers tuned: {res['diffusers_tuned_ms']:.0f} ms (peak {res['diffusers_tuned_peak_gib']:.1f} GiB)")
    for e in res["fastwan"].values():
        groups = ", ".join(f"{k} {v:.0f}" for k, v in e.get("kernel_ms", {}).items())
        tuned = f", {e['speedup_vs_tuned']:.3f}x tuned" if a.tuned_peer else ""
        print(f"{e['setup']}: {e['ms']:.0f} ms ({e['speedup']:.3f}x eager{tuned}, "
              f"rel err {e['rel_err_vs_diffusers']:.2e})" + (f" kernels: {groups}" if groups else ""))
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
