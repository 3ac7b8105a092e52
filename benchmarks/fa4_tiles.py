"""FA4 (flash_attn.cute) dense forward at the Wan shapes under different sm90 tile configurations.

    python -m benchmarks.fa4_tiles [--rounds 3] [--calls 30] [--out fa4_tiles.json]

An H100 can run Wan's attention at its power cap, where a configuration that moves fewer bytes through shared
memory per FLOP can run faster even when the stand-alone peak is the same. Each configuration
(tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap) is timed in interleaved rounds of ``--calls`` back-to-back
calls (CUDA events, median per round; the figure is the median over rounds), with the SM clock and power
that ``nvidia-smi`` reports during the round. Output of every configuration is compared with the default's.
Configurations the kernel cannot build are reported as such. ``--split`` adds, for batch > 1, each configuration
run as one call per batch element (what two sequential-CFG forwards do). ``--dry-run`` (CI, no GPU): the arguments
checked and the (shape, configuration) jobs listed, with the tile the model picks on an H100 (132 SMs).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import add_dry_run, print_plan, smi_round

SHAPES = {  # name: (batch, tokens, heads)
    "1.3B-480p-B1": (1, 32760, 12),
    "1.3B-480p-B2": (2, 32760, 12),
    "1.3B-720p-B2": (2, 75600, 12),
    "14B-480p-B2": (2, 32760, 40),
    "14B-720p-B1": (1, 75600, 40),
    "14B-720p-B2": (2, 75600, 40),
    "5B-720p-B2": (2, 27280, 24),
}
CONFIGS = [  # (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap); the first is FA4's sm90 default for D=128
    (128, 128, True, True),
    (128, 176, True, True),
    (128, 160, True, True),
    (128, 192, True, True),
    (128, 144, True, True),
    (128, 128, False, True),
    (192, 128, False, True),
    (192, 112, False, True),
    (192, 96, False, True),
    (192, 128, False, False),
    (192, 128, True, True),
    (64, 64, True, True),  # 64-row tiles: one MMA warpgroup per CTA, as 64-token sparse blocks (VSA's cubes) run
    (64, 128, True, True),
    (64, 64, False, True),
    (64, 128, False, True),
]


def runs(chosen: list, batch: int, split: bool) -> list[tuple]:
    """(tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap, per batch element?) of each timed configuration."""
    return [(*c, False) for c in chosen] + ([(*c, True) for c in chosen] if split and batch > 1 else [])


def plan(shapes: list[str], chosen: list, a, sms: int = 132) -> list[str]:
    """The (shape, configuration) jobs of a run and the tile ``fa4_sm90_tile_m`` picks at ``sms`` SMs."""
    from fastwan.attention.backends.fa4_plan import fa4_sm90_tile_m

    jobs = []
    for shape in shapes:
        b, n, h = SHAPES[shape]
        pick = fa4_sm90_tile_m(b, n, h, sms)
        jobs += [f"{shape} (B={b}, S={n}, H={h}): tile {tm}x{tn}, rs {rs}, overlap {ol}"
                 f"{', one call per batch element' if per_b else ''}; {a.rounds} rounds of {a.calls} calls "
                 f"(model picks {pick} at {sms} SMs)" for tm, tn, rs, ol, per_b in runs(chosen, b, a.split)]
    return jobs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fa4_tiles", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--shapes", default="1.3B-480p-B2,14B-720p-B1")
    p.add_argument("--configs", default="", help="indices into CONFIGS to run (default: all), e.g. 0,6")
    p.add_argument("--split", action="store_true",
                   help="also time each configuration as one call per batch element (batch > 1 shapes)")
    p.add_argument("--out", default="fa4_tiles.json")
    add_dry_run(p)
    a = p.parse_args(argv)
    shapes = a.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"--shapes: unknown shape(s) {unknown}; use {', '.join(SHAPES)}")
    try:
        chosen = [CONFIGS[int(i)] for i in a.configs.split(",")] if a.configs else CONFIGS
    except (ValueError, IndexError):
        p.error(f"--configs {a.configs!r}: use indices 0..{len(CONFIGS) - 1} into CONFIGS, comma-separated")
    if a.dry_run:
        return print_plan(p.prog, plan(shapes, chosen, a))
    from flash_attn.cute.interface import _flash_attn_fwd

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": [],
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    from fastwan.attention.backends.fa4_plan import fa4_sm90_tile_m

    for shape in shapes:
        b, n, h = SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, n, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        flops = 4 * b * h * n * n * 128
        fns, ref = {}, None
        for cfg in runs(chosen, b, a.split):
            tm, tn, rs, ol, split = cfg

            def fn(tm=tm, tn=tn, rs=rs, ol=ol, split=split, qkv=(q, k, v)):
                kw = dict(softmax_scale=128 ** -0.5, tile_mn=(tm, tn), mma_pv_is_rs=rs, intra_wg_overlap=ol)
                if not split:
                    return _flash_attn_fwd(*qkv, **kw)[0]
                out = torch.empty_like(qkv[0])  # one call per batch element, into slices of one output
                for i in range(out.shape[0]):
                    _flash_attn_fwd(*(t[i:i + 1] for t in qkv), out=out[i:i + 1], **kw)
                return out
            try:
                t0 = time.perf_counter()
                out = fn()
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
            except Exception as exc:
                msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                print(f"{shape} {cfg}: cannot build ({msg})", flush=True)
                res["rows"].append({"shape": shape, "config": list(cfg), "error": msg})
                continue
            if ref is None:
                ref = out
            err = float((out.float() - ref.float()).abs().max())
            print(f"{shape} {cfg}: built in {compile_s:.1f} s, max |out - default| {err:.2e}", flush=True)
            fns[cfg] = (fn, err)
        per = {cfg: [] for cfg in fns}
        for _ in range(a.rounds):
            for cfg, (fn, _) in fns.items():
                fn()
                per[cfg].append(smi_round(fn, a.calls))
        for cfg, rounds in per.items():
            ms = statistics.median(r[0] for r in rounds)
            row = {"shape": shape, "config": list(cfg), "ms": round(ms, 3),
                   "rounds_ms": [round(r[0], 3) for r in rounds],
                   "tflops": round(flops / ms / 1e9, 1), "sm_mhz": statistics.median(r[1] for r in rounds),
                   "power_w": statistics.median(r[2] for r in rounds), "max_err_vs_default": fns[cfg][1]}
            row["model_pick"] = fa4_sm90_tile_m(b, n, h, res["sms"])
            res["rows"].append(row)
        del q, k, v, fns, ref
        torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"\n{'shape':<14} {'tile_m x tile_n':<16} {'rs':<3} {'ol':<3} {'ms':>9} {'TFLOP/s':>8} {'MHz':>6} {'W':>5} "
          f"{'model':>5}")
    for r in res["rows"]:
        tm, tn, rs, ol, split = r["config"]
        tile = f"{tm}x{tn}" + (" per-b" if split else "")
        if "error" in r:
            print(f"{r['shape']:<14} {tile:<16} {int(rs):<3} {int(ol):<3} cannot build")
            continue
        print(f"{r['shape']:<14} {tile:<16} {int(rs):<3} {int(ol):<3} {r['ms']:>9.2f} {r['tflops']:>8.0f} "
              f"{r['sm_mhz']:>6.0f} {r['power_w']:>5.0f} {r['model_pick']:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
