"""Speed levers of the 1.3B DiT forward, A/B in one process on the same random weights (issue 5).

Each variant is a separately loaded model (same checkpoint) with FLASH_ATTN; forwards are timed in
interleaved rounds (A B C ... A B C ...) so clock/thermal drift hits all variants alike. Per variant: median
forward ms at batch 1 and 2, a torch.profiler breakdown (attention / GEMM / norms / other, kernel total vs
wall), and the SM clock and power sampled by nvidia-smi while it ran. Also: a standalone FA4 call at the
model's attention shape right after the model runs, and (``--cuda-graph``) one CUDA-graph replay of a
compiled forward.

  python benchmarks/levers.py --ckpt /tmp/wan13b-random --out levers.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e import cuda_time, forward_inputs, make_checkpoint, versions  # noqa: E402
from profile_forward import kernel_groups  # noqa: E402

VARIANTS = {  # label: how the model is set up (missing keys: False / None / "auto")
    "eager": {},
    "compiled": {"compile": True},
    "compiled+gelu": {"compile": True, "gelu": True},
    "compiled+qkv": {"compile": True, "qkv": True},
    "compiled+qkv+gelu": {"compile": True, "qkv": True, "gelu": True},
    # FA4's sm90 query tile (FLASH_ATTN fa4_tile_m; "auto" picks by shape). A variant may also carry Inductor
    # "options" for torch.compile (RESULTS.md 8.2: {"triton.multi_kernel": 1} fails to compile on torch 2.11).
    "gelu+t128": {"compile": True, "gelu": True, "tile": 128},
    "gelu+t192": {"compile": True, "gelu": True, "tile": 192},
    # single-pass Triton norms (fastwan.models.fused; set_fast_paths(fused_norms=...)); the variants above
    # run without them, as before they existed
    "gelu+fn": {"compile": True, "gelu": True, "fn": True},
    "gelu+fn+t128": {"compile": True, "gelu": True, "fn": True, "tile": 128},
    # the residual adds of the output projections in their GEMMs (set_fast_paths(gemm_residual=...); on by
    # default, used at batch 1 only): "gelu+fn" has it, "gelu+fn+nogr" runs the residual_norm_mod route
    "gelu+fn+nogr": {"compile": True, "gelu": True, "fn": True, "gr": False},
    # Inductor's GEMM autotuning (cuBLAS against its Triton templates, per shape; plain and with the persistent
    # TMA templates for sm90)
    "gelu+fn+autotune": {"compile": True, "gelu": True, "fn": True,
                         "options": {"max_autotune": True, "max_autotune_gemm_backends": "ATEN,TRITON"}},
    "gelu+fn+autotune-tma": {"compile": True, "gelu": True, "fn": True,
                             "options": {"max_autotune": True, "max_autotune_gemm_backends": "ATEN,TRITON",
                                         "triton.enable_persistent_tma_matmul": True}},
}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


class Smi:
    """nvidia-smi sampling (SM clock MHz, power W) in the background; windows are cut by wall time."""

    def __init__(self, path: Path):
        self.path = path
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
             "--format=csv,noheader,nounits", "-lms", "100"], stdout=open(path, "w"), stderr=subprocess.DEVNULL)
        self.windows: dict[str, list[tuple[float, float]]] = {}

    def mark(self, label: str, t0: float, t1: float) -> None:
        self.windows.setdefault(label, []).append((t0, t1))

    def summary(self) -> dict:
        self.proc.terminate()
        time.sleep(0.3)
        rows = []
        for line in self.path.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
                ts += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
                rows.append((ts, float(parts[1]), float(parts[2]), float(parts[3])))
            except (ValueError, IndexError):
                continue
        out = {}
        for label, wins in self.windows.items():
            sel = [r for r in rows if any(a <= r[0] <= b for a, b in wins)]
            if sel:
                out[label] = {"sm_mhz": statistics.median(r[1] for r in sel),
                              "power_w": statistics.median(r[2] for r in sel),
                              "temp_c": max(r[3] for r in sel), "samples": len(sel)}
        return out


def profile_groups(fn) -> dict:
    """Kernel time per group for one call, and the wall time of a plain (unprofiled) call."""
    groups = kernel_groups(fn)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    return {"groups_ms": groups, "kernel_total_ms": sum(groups.values()), "wall_ms": wall}


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default="/tmp/wan13b-random")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--cuda-graph", action="store_true")
    p.add_argument("--smi", default="smi.csv")
    p.add_argument("--out", default="levers.json")
    a = p.parse_args(argv)

    from fastwan.attention import AttentionDispatch
    from fastwan.models import load_transformer

    import torch._dynamo.config as dcfg

    # every variant shares the block code object (guards differ per variant and batch): allow the recompiles
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dcfg, name):
            setattr(dcfg, name, max(getattr(dcfg, name), 64 if "accumulated" not in name else 512))
    root = Path(a.ckpt)
    if not (root / "transformer").exists():
        make_checkpoint(root, "1.3b")
    res: dict = {"versions": versions(), "variants": {}}
    smi = Smi(Path(a.smi))
    def dispatch(tile):
        return AttentionDispatch.resolve("FLASH_ATTN", device="cuda", dtype=torch.bfloat16, head_dim=128,
                                         config={"fa4_tile_m": tile or "auto"})

    res["attention"] = dispatch(None).describe("cuda")
    inputs = {b: forward_inputs(b) for b in (1, 2)}
    models = {}
    ref = None
    for label in a.variants.split(","):
        v = VARIANTS[label]
        comp, qkv, gelu = v.get("compile", False), v.get("qkv", False), v.get("gelu", False)
        m = load_transformer(root / "transformer", dtype=torch.bfloat16, device="cuda",
                             attention=dispatch(v.get("tile")))
        m.set_fast_paths(fuse_qkv=qkv, gelu_epilogue=gelu, fused_norms=v.get("fn", False),
                         gemm_residual=v.get("gr", True))
        if comp:
            for blk in m.blocks:
                blk.compile(fullgraph=True, **({"options": v["options"]} if v.get("options") else {}))
        t0 = time.perf_counter()
        out = {b: m(*inputs[b]).float() for b in (1, 2)}
        torch.cuda.synchronize()
        entry = res["variants"].setdefault(label, {"compile": comp, "fuse_qkv": qkv, "gelu_epilogue": gelu,
                                                   "fa4_tile_m": v.get("tile") or "auto",
                                                   "fused_norms": v.get("fn", False),
                                                   "compile_options": v.get("options")})
        entry["warmup_s"] = time.perf_counter() - t0
        if ref is None:
            ref = out
        entry["rel_err_vs_first"] = {b: ((out[b] - ref[b]).norm() / ref[b].norm()).item() for b in (1, 2)}
        models[label] = m
        log(f"{label}: warm-up {entry['warmup_s']:.1f} s, rel err vs {next(iter(models))} {entry['rel_err_vs_first']}")
    del out, ref

    times = {label: {1: [], 2: []} for label in models}
    for r in range(a.rounds):
        for label, m in models.items():
            for b in (1, 2):
                t0 = time.time()
                times[label][b].append(cuda_time(lambda m=m, b=b: m(*inputs[b]), warmup=1, iters=a.iters))
                smi.mark(label, t0, time.time())
        log(f"round {r}: " + ", ".join(f"{k} {v[2][-1]:.1f}" for k, v in times.items()))
    for label, m in models.items():
        e = res["variants"][label]
        e["b1_ms"] = statistics.median(times[label][1])
        e["b2_ms"] = statistics.median(times[label][2])
        e["b2_runs_ms"] = times[label][2]
        e["profile_b1"] = profile_groups(lambda m=m: m(*inputs[1]))
        e["profile_b2"] = profile_groups(lambda m=m: m(*inputs[2]))

    # standalone FA4 at the model's shape, straight after the models ran (same clocks/thermals)
    try:
        from flash_attn.cute import flash_attn_func

        g = torch.Generator("cuda").manual_seed(0)
        qkv = [torch.randn(2, 32760, 12, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
        t0 = time.time()
        ms = statistics.median([cuda_time(lambda: flash_attn_func(*qkv), warmup=2, iters=10) for _ in range(3)])
        smi.mark("fa4_standalone", t0, time.time())
        res["fa4_standalone_b2_ms_per_layer"] = ms
        res["fa4_standalone_b2_x30_ms"] = 30 * ms
        res["fa4_standalone_tflops"] = 4 * 2 * 12 * 32760**2 * 128 / (ms * 1e-3) / 1e12
    except Exception as exc:
        res["fa4_standalone_error"] = repr(exc)

    if a.cuda_graph:
        label = next((lb for lb in models if VARIANTS[lb].get("compile")), None)
        try:
            m = models[label]
            static = [t.clone() for t in inputs[2]]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    m(*static)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                m(*static)
            res["cuda_graph"] = {"variant": label, "b2_ms": cuda_time(graph.replay, warmup=2, iters=5),
                                 "b2_ms_no_graph": cuda_time(lambda: m(*static), warmup=1, iters=5)}
            del graph
        except Exception as exc:
            res["cuda_graph"] = {"variant": label, "error": repr(exc)[:500]}
        log(f"cuda graph: {res['cuda_graph']}")

    res["smi"] = smi.summary()
    Path(a.out).write_text(json.dumps(res, indent=1, default=str))
    print(f"\n{'variant':<20} {'B=1 ms':>8} {'B=2 ms':>8} {'attn':>7} {'gemm':>7} {'norms':>7} {'other':>7} "
          f"{'kern':>7} {'wall':>7} {'MHz':>6} {'W':>5}")
    for label, e in res["variants"].items():
        g = e["profile_b2"]["groups_ms"]
        sm = res["smi"].get(label, {})
        print(f"{label:<20} {e['b1_ms']:>8.1f} {e['b2_ms']:>8.1f} {g.get('attention', 0):>7.1f} "
              f"{g.get('gemm', 0):>7.1f} {g.get('norms', 0):>7.1f} {g.get('elementwise/other', 0):>7.1f} "
              f"{e['profile_b2']['kernel_total_ms']:>7.1f} {e['profile_b2']['wall_ms']:>7.1f} "
              f"{sm.get('sm_mhz', 0):>6.0f} {sm.get('power_w', 0):>5.0f}")
    if "fa4_standalone_b2_x30_ms" in res:
        sm = res["smi"].get("fa4_standalone", {})
        print(f"FA4 standalone B=2 x30 layers: {res['fa4_standalone_b2_x30_ms']:.1f} ms "
              f"({res['fa4_standalone_tflops']:.0f} TFLOP/s), {sm.get('sm_mhz', 0):.0f} MHz "
              f"{sm.get('power_w', 0):.0f} W")
    return 0


if __name__ == "__main__":
    sys.exit(main())
