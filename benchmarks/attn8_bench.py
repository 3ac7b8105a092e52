"""fastwan's 8-bit attention (fastwan::attn8) against bf16 FA4 and SDPA at Wan's self-attention shapes, and the sweep
that picks its launch configuration (the table in fastwan/kernels/attn8_configs.py).

    python -m benchmarks.attn8_bench --out attn8_bench.json       # H100 / H200: under 4 minutes
    python -m benchmarks.attn8_bench --smoke                      # CI: a tiny shape on the CPU, PyTorch references
    TRITON_INTERPRET=1 python -m benchmarks.attn8_bench --smoke --interpret   # the kernels under Triton's interpreter

Shapes (bf16, D = 128, Wan-like q, k, v from fastwan.attention.synthetic): 1.3b-480p [1, 32760, 12, 128] and
14b-720p [1, 75600, 40, 128]. Rows per shape:
  fa4-bf16       the FLASH_ATTN backend with version 4 (flash_attn.cute, fastwan's sm90 tile plan); where it cannot
                 run, the row says why and SDPA stands in as the "x FA4" reference
  sdpa-bf16      torch's scaled_dot_product_attention (its own kernel choice)
  v1-torchquant  the first attn8 op: ``quantize`` in PyTorch, then kernel version 1 (128 / 64, 8 warps, 3 stages)
  <label>        a configuration (Attn8Config.label): the fused Triton quantizer, then the kernel; its time is the
                 quantizer's (per block pair) plus the kernel's
The sweep, on the first shape: the --first labels; then the --options applied to the two fastest; then the fastest
so far at one stage less and more. Later shapes time the --top fastest, the table's configuration and the rows above.
Each time is the median of --iters calls (CUDA events) after a first call (its compile) and --warmup calls; no
configuration starts once --budget-s has passed (the later shapes get the last 30%). Errors: rel. L2 and cosine
against exact attention (fp32, the memory-efficient SDPA kernel) on every --row-stride'th query row. A
configuration that fails (e.g. shared memory) prints its reason; the run goes on (after a kernel fault, which loses
the CUDA context, it stops and writes what it has). The table is sorted by time; the
best configuration (lowest mean ratio to FA4 over the shapes it ran on, rel. L2 <= 3e-2) is printed with its entry
for the table; --out holds the JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.harness import SMOKE_DIR, add_device, add_smoke, command, device_arg, log, output, parse_args, versions
from fastwan.attention.synthetic import wan_like_qkv
from fastwan.kernels import attn8 as A
from fastwan.kernels import interpreted_kernels
from fastwan.kernels.attn8_configs import config_for, parse_config
from fastwan.profiler import time_fn

SHAPES = {"1.3b-480p": ((21, 30, 52), 12, 128), "14b-720p": ((21, 45, 80), 40, 128), "tiny": ((3, 5, 7), 2, 64)}
# sm90 builds (compiled on the CPU) without spills; fewest SASS instructions a score first
FIRST = ("v2-m128-n128-w8-s2-desc", "v2-m128-n128-w8-s3-desc", "v2-m64-n128-w4-s3-desc", "v2-m128-n256-w8-s2-desc",
         "v2-m128-n64-w8-s3-desc", "v2-m128-n64-w8-s4-desc", "v2-m64-n128-w4-s4-desc", "v2-m64-n64-w4-s4-desc",
         "v2-m128-n64-w8-s3", "v1-m128-n64-w8-s3")
OPTIONS = ("fold-ffma", "fold", "ffma", "fold-cvt", "ws-fold-ffma", "poly2d3-fold-ffma", "poly4d3-fold-ffma")
OPTION_FIELDS = {"fold": {"fold": True}, "ffma": {"ffma": True}, "cvt": {"cvt": True},
                 "ws": {"warp_specialize": True}, "poly2d3": {"poly_group": 2, "poly_degree": 3},
                 "poly4d3": {"poly_group": 4, "poly_degree": 3}, "poly2d4": {"poly_group": 2, "poly_degree": 4}}
V1 = "v1-m128-n64-w8-s3"
MAX_REL_L2 = 3e-2
CUDA_FAULTS = ("illegal memory access", "unspecified launch failure", "misaligned address", "illegal instruction")


def with_options(label: str, options: str) -> str | None:
    """``label`` with ``options`` ("fold-ffma": fields of :data:`OPTION_FIELDS` joined by "-") switched on; the
    poly options at 2 stages (every unrolled block has its own buffers), None where their keys pass 256 (shared
    memory)."""
    cfg = parse_config(label)
    for name in options.split("-"):
        cfg = cfg._replace(**OPTION_FIELDS[name])
    if cfg.poly_group:
        cfg = cfg._replace(num_stages=min(cfg.num_stages, 2))
    return None if cfg.poly_group * cfg.block_n > 256 else parse_config(cfg.label).label


def exact_rows(q, k, v, rows):
    """Exact attention (fp32 memory-efficient SDPA on CUDA, float64 elsewhere) of query ``rows`` -> [B, n, H, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.float32 if q.is_cuda else torch.float64
    args = [t.to(dtype).transpose(1, 2) for t in (q[:, rows], k, v)]
    if q.is_cuda:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(*args).transpose(1, 2)
    return F.scaled_dot_product_attention(*args).transpose(1, 2)


class Shape:
    """One shape's inputs, exact rows, and the timing of its rows."""

    def __init__(self, name: str, args, device):
        grid, heads, dim = SHAPES[name]
        self.name, self.args, self.device = name, args, device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.q, self.k, self.v = wan_like_qkv(grid, heads, dim, dtype=dtype, device=device, seed=0)
        self.scale = dim ** -0.5
        self.rows = torch.arange(0, self.q.shape[1], args.row_stride, device=device)
        self.exact = exact_rows(self.q, self.k, self.v, self.rows)
        self.triton = device.type == "cuda" or args.interpret  # the fused quantizer and kernels, else references
        self.quant_ms: dict = {}
        self.results: list = []

    def errors(self, out) -> dict:
        got, ref = out[:, self.rows].double(), self.exact.double()
        return {"rel_l2": float((got - ref).norm() / ref.norm()),
                "cos": float(F.cosine_similarity(got.flatten(), ref.flatten(), dim=0))}

    def time(self, fn) -> float:
        return statistics.median(time_fn(fn, warmup=self.args.warmup, iters=self.args.iters, device=self.device))

    def measure(self, label: str, run, quantize=None, key=None) -> dict:
        """Row ``label``: ``run()`` (the kernel; with ``quantize``, on its output), first call, errors, times."""
        row = {"shape": self.name, "variant": label}
        if self.args.lost:  # a kernel faulted: the CUDA context is gone, nothing else runs
            row["skipped"] = f"the CUDA context was lost at {self.args.lost}"
            self.results.append(row)
            return row
        try:
            t0 = time.perf_counter()
            t = quantize() if quantize else None
            out = run(t) if quantize else run()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            row.update(self.errors(out))
            del out
            row["kernel_ms"] = self.time((lambda: run(t)) if quantize else run)
            if quantize:
                if key not in self.quant_ms:
                    self.quant_ms[key] = self.time(quantize)
                row["quant_ms"] = self.quant_ms[key]
            row["ms"] = row["kernel_ms"] + row.get("quant_ms", 0.0)
        except Exception as exc:  # a configuration the GPU cannot run (shared memory, a compile error): go on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            if any(fault in str(exc) for fault in CUDA_FAULTS):
                self.args.lost = f"{self.name} {label}"
        self.results.append(row)
        status = row.get("error") or (f"{row['ms']:.3f} ms ({row.get('quant_ms', 0):.3f} quantizing), rel L2 "
                                      f"{row['rel_l2']:.2e}, cos {row['cos']:.6f}, first call "
                                      f"{row['first_call_s']:.1f} s")
        log(f"  {label:42s} {status}")
        return row

    def baselines(self) -> None:
        q, k, v = self.q, self.k, self.v
        if q.is_cuda:
            from fastwan.attention import create_backend

            fa4 = create_backend("FLASH_ATTN", {"version": 4})
            why = fa4.reasons(device=q.device, dtype=q.dtype, head_dim=q.shape[-1], seq_q=q.shape[1],
                              seq_kv=k.shape[1])
            if why:
                self.results.append({"shape": self.name, "variant": "fa4-bf16", "skipped": "; ".join(why)})
                log(f"  fa4-bf16 skipped ({'; '.join(why)}): sdpa-bf16 stands in for FA4")
            else:
                self.measure("fa4-bf16", lambda: fa4(q, k, v, scale=self.scale))
        self.measure("sdpa-bf16" if q.is_cuda else "sdpa-fp32", lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=self.scale).transpose(1, 2))
        v1 = parse_config(V1)
        self.measure("v1-torchquant", lambda t: self.kernel(t, v1),
                     lambda: A.quantize(q, k, v, self.scale, True, v1.block_m, v1.block_n), key="torch")

    def kernel(self, t, cfg):
        """The kernel of ``cfg`` on ``t``: the Triton kernel on CUDA or under --interpret, else the reference."""
        return A.attend(t, cfg, self.q.dtype) if self.triton else A.attention_reference(t)

    def config(self, label: str) -> dict:
        cfg = parse_config(label)
        q, k, v = self.q, self.k, self.v
        quant = A.quantize_fused if self.triton else A.quantize
        row = self.measure(label, lambda t: self.kernel(t, cfg),
                           lambda: quant(q, k, v, self.scale, True, cfg.block_m, cfg.block_n),
                           key=(cfg.block_m, cfg.block_n))
        row["route"] = "triton" if self.triton else "reference"
        return row

    def reference_ms(self) -> float | None:
        for name in ("fa4-bf16", "sdpa-bf16", "sdpa-fp32"):
            row = next((r for r in self.results if r["variant"] == name and "ms" in r), None)
            if row:
                return row["ms"]
        return None


def fastest(shape: Shape, labels, n: int) -> list:
    rows = [r for r in shape.results if r["variant"] in labels and "ms" in r and r["rel_l2"] <= MAX_REL_L2]
    return [r["variant"] for r in sorted(rows, key=lambda r: r["ms"])[:n]]


def sweep(shape: Shape, args, deadline: float) -> list:
    """The configurations of the first shape: --first, the --options on the two fastest, then stages +-1."""
    done: list = []

    def run(labels) -> None:
        for label in labels:
            if label is None or label in done:
                continue
            if time.perf_counter() > deadline:
                shape.results.append({"shape": shape.name, "variant": label, "skipped": "--budget-s spent"})
                continue
            done.append(label)
            shape.config(label)

    run(args.first)
    run([with_options(b, o) for b in fastest(shape, done, 2) if parse_config(b).version == 2 for o in args.options])
    for best in fastest(shape, done, 1):
        cfg = parse_config(best)
        run([cfg._replace(num_stages=s).label for s in (cfg.num_stages - 1, cfg.num_stages + 1) if 1 <= s <= 5])
    return done


def best_config(shapes: list) -> str | None:
    """The configuration with the lowest mean ratio of its time to the shape's FA4 (or stand-in) time, over the
    shapes it ran on, among those that ran on the most shapes."""
    ratios: dict = {}
    for shape in shapes:
        ref = shape.reference_ms()
        for r in shape.results:
            if ref and "ms" in r and r["variant"] not in ("fa4-bf16", "sdpa-bf16", "sdpa-fp32", "v1-torchquant") \
                    and r["rel_l2"] <= MAX_REL_L2:
                ratios.setdefault(r["variant"], []).append(r["ms"] / ref)
    if not ratios:
        return None
    most = max(len(v) for v in ratios.values())
    return min((k for k, v in ratios.items() if len(v) == most), key=lambda k: statistics.mean(ratios[k]))


def table(shapes: list) -> None:
    print("| shape | variant | ms | x FA4 (or stand-in) | kernel ms | quant ms | rel L2 | cos | first call s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        ref = shape.reference_ms()
        for r in sorted(shape.results, key=lambda r: r.get("ms", float("inf"))):
            if "ms" not in r:
                print(f"| {shape.name} | {r['variant']} | {r.get('skipped') or r.get('error')} |")
                continue
            speed = f"{ref / r['ms']:.2f}" if ref else "-"
            print(f"| {shape.name} | {r['variant']} | {r['ms']:.3f} | {speed} | {r['kernel_ms']:.3f} | "
                  f"{r.get('quant_ms', 0.0):.3f} | {r['rel_l2']:.2e} | {r['cos']:.6f} | {r['first_call_s']:.1f} |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attn8_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1.3b-480p,14b-720p",
                   help=f"comma-separated, the sweep on the first: {', '.join(SHAPES)}")
    p.add_argument("--first", default=",".join(FIRST), help="configuration labels the sweep starts with")
    p.add_argument("--options", default=",".join(OPTIONS),
                   help=f"option sets tried on the two fastest ('-'-joined: {', '.join(OPTION_FIELDS)}); '' for none")
    p.add_argument("--top", type=int, default=3, help="the sweep's fastest configurations timed on later shapes")
    p.add_argument("--iters", type=int, default=10, help="timed calls per row (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls after the first one")
    p.add_argument("--row-stride", type=int, default=8, help="every n-th query row is compared with exact attention")
    p.add_argument("--budget-s", type=float, default=200.0, help="no configuration starts after this many seconds")
    p.add_argument("--interpret", action="store_true",
                   help="off CUDA: run the Triton kernels under the interpreter (set TRITON_INTERPRET=1 first)")
    p.add_argument("--out", default="attn8_bench.json", help="results JSON")
    add_device(p)
    add_smoke(p, shapes="tiny", first="v2-m32-n16-w4-s2,v2-m16-n32-w4-s1-desc,v1-m16-n16-w4-s1",
              options="fold-ffma,poly2d3", iters=1, warmup=1, row_stride=1, out=str(SMOKE_DIR / "attn8_bench.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if not names or any(n not in SHAPES for n in names):
        parser.error(f"--shapes {args.shapes!r}: use one or more of {', '.join(SHAPES)}")
    args.first = [s.strip() for s in args.first.split(",") if s.strip()]
    args.options = [s.strip() for s in args.options.split(",") if s.strip()]
    try:
        for label in args.first:
            parse_config(label)
        for opt in args.options:
            with_options(FIRST[0], opt)
    except (ValueError, KeyError) as exc:
        parser.error(f"--first / --options: {exc}")
    if args.iters < 1 or args.warmup < 0 or args.top < 0 or args.row_stride < 1:
        parser.error("need --iters >= 1, --warmup >= 0, --top >= 0 and --row-stride >= 1")
    device = device_arg(parser, args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here; use --smoke (or --device cpu)")
    if args.interpret and device.type == "cuda":
        parser.error("--interpret runs the kernels on the CPU: use it with --smoke / --device cpu")
    args.lost = None  # where a kernel fault lost the CUDA context
    start = time.perf_counter()
    shapes, ran = [], []
    with interpreted_kernels() if args.interpret else contextlib.nullcontext(), torch.no_grad():
        for i, name in enumerate(names):
            if args.lost:
                log(f"== {name}: not run, the CUDA context was lost at {args.lost}")
                break
            shape = Shape(name, args, device)
            log(f"== {name}: q/k/v {list(shape.q.shape)} {shape.q.dtype}, {len(shape.rows)} rows checked")
            shape.baselines()
            if i == 0:
                ran = sweep(shape, args, start + 0.7 * args.budget_s)
            else:
                table_cfg = config_for(shape.q.shape[-1], A.capability(device)).label
                for label in dict.fromkeys([*fastest(shapes[0], ran, args.top), table_cfg]):
                    if time.perf_counter() > start + args.budget_s:
                        shape.results.append({"shape": name, "variant": label, "skipped": "--budget-s spent"})
                    else:
                        shape.config(label)
            shapes.append(shape)
            del shape.q, shape.k, shape.v, shape.exact
            if device.type == "cuda":
                torch.cuda.empty_cache()
    best = best_config(shapes)
    record = {"command": command("benchmarks.attn8_bench", argv), "versions": versions(),
              "seconds": time.perf_counter() - start, "best": best,
              "results": [r for s in shapes for r in s.results]}
    if best:
        cfg = parse_config(best)
        cap = A.capability(device)
        record["table_entry"] = f"({SHAPES[names[0]][2]}, {cap}): {cfg!r},"
    out = output(args.out)
    out.write_text(json.dumps(record, indent=1, default=str))
    log(f"wrote {out} ({record['seconds']:.0f} s)")
    table(shapes)
    print(f"best: {best}" + (f"; its entry for CONFIGS in fastwan/kernels/attn8_configs.py: {record['table_entry']}"
                             if best else " (no configuration ran within the error bound)"))
    return 0 if best and all(s.reference_ms() for s in shapes) else 1


if __name__ == "__main__":
    sys.exit(main())
