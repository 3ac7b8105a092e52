"""Probe (scratch): VSA's fine stage on 64-token cubes through FA4 in other ways than 64 x 64 block sparsity.

    python -m benchmarks.probes.vsa64_probe --out probe.json

For each shape and sparsity: the backend's own fine stage (FA4 block sparse, 64 x 64 tiles), then the same
selection as FA4 paged KV: one "sequence" per (head, query cube) of 64 queries, its pages the selected key cubes
(page size 64) in head-major copies of k and v, at several FA4 tiles. Also the gated combine, unfused vs addcmul,
and a torch.profiler table of one whole backend call (host overhead).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from fastwan.attention.base import AttentionMetadata
from fastwan.attention.registry import create_backend
from fastwan.attention.sparse.vsa import topk_count
from fastwan.attention.synthetic import wan_like_qkv
from fastwan.profiler import time_fn

SHAPES = {"div-480p": ((20, 28, 52), 12), "1.3b-480p": ((21, 30, 52), 12), "14b-720p": ((21, 45, 80), 40)}


def med(fn, iters=20):
    return round(statistics.median(time_fn(fn, warmup=3, iters=iters, device=torch.device("cuda"))), 4)


def head_major(x, n):
    """[1, n*64, H, D] -> [H*n, 64, 1, D] (a copy)."""
    _, _, H, D = x.shape
    return x.view(n, 64, H, D).permute(2, 0, 1, 3).reshape(H * n, 64, 1, D).contiguous()


def back(o, n, H):
    """[H*n, 64, 1, D] -> [1, n*64, H, D] (a copy)."""
    D = o.shape[-1]
    return o.view(H, n, 64, D).permute(1, 2, 0, 3).reshape(1, n * 64, H, D)


def probe(shape, sparsity, rows):
    from flash_attn.cute.interface import _flash_attn_fwd

    grid, H = SHAPES[shape]
    q, k, v = wan_like_qkv(grid, H, 128, dtype=torch.bfloat16, device="cuda")
    gate = torch.randn_like(q)
    be = create_backend("VIDEO_SPARSE_ATTN", {"tile": [4, 4, 4], "sparsity": sparsity, "kernel": "fa4",
                                              "block_size": 64})
    lay = be.layout(grid, "cuda")
    q, k, v, gate = (lay.permute(t, dim=1) for t in (q, k, v, gate))
    n = lay.num_tiles
    kk = topk_count(sparsity, n)
    scale = 128 ** -0.5
    plan, coarse = be.select(q, k, v, lay, scale, sparsity, with_output=True)
    sel = torch.sort((~plan.any).to(torch.uint8), dim=-1, stable=True).indices[..., :kk]  # [1, H, n, kk]
    base = {"shape": shape, "sparsity": sparsity, "cubes": n, "k": kk, "dummies": bool(lay.has_dummies)}
    ref = be.run_plan(plan, q, k, v, scale)
    rows.append({**base, "case": "blocksparse 64x64 (fine only)", "ms": med(lambda: be.run_plan(plan, q, k, v, scale))})
    meta = AttentionMetadata(grid=grid, step_index=0, num_steps=1, layer_index=0, layout=lay,
                             extra={"gate_compress": gate})
    rows.append({**base, "case": "backend call (select+fine+combine)", "ms": med(lambda: be(q, k, v, meta=meta))})
    pt = (sel[0] + torch.arange(H, device="cuda").view(H, 1, 1) * n).reshape(H * n, kk).to(torch.int32).contiguous()
    qh, kh, vh = (head_major(t, n) for t in (q, k, v))
    rows.append({**base, "case": "head-major copies q,k,v", "ms": med(lambda: [head_major(t, n) for t in (q, k, v)])})
    for tm in (None, (64, 64), (64, 128), (128, 128), (128, 64)):
        row = {**base, "case": f"paged tile {tm}"}
        rows.append(row)
        try:
            def fn(tm=tm):
                return _flash_attn_fwd(qh, kh, vh, page_table=pt, softmax_scale=scale, tile_mn=tm)[0]
            out = fn()
            row["ms"] = med(fn)
            if not lay.has_dummies:
                row["max_abs_diff_vs_blocksparse"] = float((back(out, n, H).float() - ref.float()).abs().max())
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    per_tile = (1, n, 64, H, 128)
    c = coarse
    rows.append({**base, "case": "combine unfused", "ms": med(
        lambda: ref + c.unsqueeze(2).expand(per_tile).reshape(ref.shape) * gate)})
    rows.append({**base, "case": "combine addcmul", "ms": med(
        lambda: torch.addcmul(ref.view(per_tile), c.unsqueeze(2), gate.view(per_tile)).view(ref.shape))})
    own = create_backend("VIDEO_SPARSE_ATTN", {"tile": "auto", "sparsity": sparsity})
    olay = own.layout(grid, "cuda")
    oq, ok_, ov, og = (olay.permute(lay.unpermute(t, dim=1), dim=1) for t in (q, k, v, gate))
    ometa = AttentionMetadata(grid=grid, step_index=0, num_steps=1, layer_index=0, layout=olay,
                              extra={"gate_compress": og})
    rows.append({**base, "case": "own tiles backend call", "ms": med(lambda: own(oq, ok_, ov, meta=ometa))})
    if shape == "1.3b-480p" and sparsity == 0.9:
        from torch.profiler import ProfilerActivity, profile
        for _ in range(3):
            own(oq, ok_, ov, meta=ometa)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                own(oq, ok_, ov, meta=ometa)
            torch.cuda.synchronize()
        return prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.vsa64_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sparsity", default="0.9,0.8")
    args = ap.parse_args(argv)
    rows, tables = [], []
    for shape in args.shapes.split(","):
        for s in (float(x) for x in args.sparsity.split(",")):
            with torch.inference_mode():
                t = probe(shape, s, rows)
            if t:
                tables.append(t)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "profile": tables}, f, indent=1)
    for t in tables:
        print(t)
    for r in rows:
        extra = r.get("error") or r.get("max_abs_diff_vs_blocksparse", "")
        ms = r.get("ms", float("nan"))
        print(f"{r['shape']:10s} {r['sparsity']:.1f} k={r['k']:4d} {r['case']:38s} {ms:9.3f} {extra}")


if __name__ == "__main__":
    main()
