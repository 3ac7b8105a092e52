"""Wan 14B DiT forward at 720p x 81 frames (75,600 tokens), batch 1: diffusers vs fastwan on the same weights.

Random weights at the real 14B shapes are created once on the GPU (diffusers module); fastwan's DiT is built
on the meta device and assigned the very same tensors (no copy), so both run identical weights.

  python benchmarks/forward_14b.py --backend FLASH_ATTN --compile --out forward_14b.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e import cuda_time, forward_inputs, versions  # noqa: E402


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="FLASH_ATTN")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default="forward_14b.json")
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
    torch.cuda.reset_peak_memory_stats()
    res["diffusers_ms"] = cuda_time(lambda: ref(*args, return_dict=False), warmup=1, iters=a.iters)
    res["diffusers_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    want = ref(*args, return_dict=False)[0].float()
    print(f"diffusers 14B forward: {res['diffusers_ms']:.0f} ms, peak {res['diffusers_peak_gib']:.1f} GiB", flush=True)

    att = AttentionDispatch.resolve(a.backend, device="cuda", dtype=torch.bfloat16, head_dim=128)
    with torch.device("meta"):
        model = WanTransformer(WanConfig.from_dict({"_class_name": "WanTransformer3DModel", **cfg}), att)
    model.load_state_dict(ref.state_dict(), assign=True, strict=True)
    model.eval()
    ref = None
    torch.cuda.empty_cache()
    if a.compile:
        for blk in model.blocks:
            blk.compile(fullgraph=True)
    got = model(*args).float()
    res["rel_err_vs_diffusers"] = ((got - want).norm() / want.norm()).item()
    del got, want
    torch.cuda.reset_peak_memory_stats()
    key = f"fastwan[{att.describe('cuda')}{', compiled' if a.compile else ''}]"
    res["fastwan_ms"] = cuda_time(lambda: model(*args), warmup=1, iters=a.iters)
    res["fastwan_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["fastwan"] = key
    res["speedup"] = res["diffusers_ms"] / res["fastwan_ms"]
    print(f"{key} 14B forward: {res['fastwan_ms']:.0f} ms, peak {res['fastwan_peak_gib']:.1f} GiB, "
          f"rel err {res['rel_err_vs_diffusers']:.2e}, speedup {res['speedup']:.2f}x", flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
