"""FastVideo's VSA (``fastvideo-kernel``'s ``video_sparse_attn``) vs fastwan's VIDEO_SPARSE_ATTN at FastWan's shapes
(bf16, CUDA, B=1, D=128, 4x4x4 cubes, gated coarse output as with a FastWan checkpoint's ``to_gate_compress``).

    python -m benchmarks.vsa_fastvideo --out vsa_fastvideo.json [--iters 20] [--warmup 3] [--sparsity 0.8,0.9]
        [--shapes 1.3b-480p,1.3b-448p-61f,14b-720p] [--cases ...] [--k-rule padded|legacy] [--budget-s 480]

FastVideo's kernels: ``pip install --no-deps fastvideo_kernel-0.3.5-cp312-...whl`` (``--no-deps``: the wheel pins
torch==2.12.0). Without them the FastVideo rows say why and the others run. Shapes (token grids of 4x4x4 cubes):
1.3B 480p 21x30x52 with 12 heads (624 cubes), 1.3B 61x448x832 16x28x52 with 12 heads (364), 14B 720p 21x45x80
with 40 heads (1,440). Inputs: Wan-like q, k, v (``fastwan.attention.synthetic``) and an N(0, 1) gate.

Cases, each the median of ``--iters`` calls (CUDA events around each synchronised call) after ``--warmup`` calls
and one first call timed on its own (Triton autotuning, torch.compile, FA4 JIT):

* ``fastvideo``        what FastVideo's backend runs per layer once q, k, v and the gate are tiled: contiguous
                       [B, H, S, D] copies of the four, ``video_sparse_attn(..., topk, block_size=(4, 4, 4),
                       compress_attn_weight=gate)``, the transpose back (a view). ``topk`` follows ``--k-rule``:
                       "padded" = ceil((1 - s) * cubes) (its backend today), "legacy" = ceil((1 - s) * tokens / 64)
                       (the rule its FastWan checkpoints were trained with);
* ``fastvideo kernel`` ``video_sparse_attn`` alone on [B, H, S, D] inputs prepared beforehand;
* ``fastvideo layer``  ``fastvideo`` plus what FastVideo's attention layer runs around every call: q, k, v, gate
                       concatenated, scattered into its reused zero-padded cube buffer, and the gather after;
* ``fastwan auto``     the backend call on tokens already in its layout (the DiT permutes once per forward, not
                       per layer), config ``{"tile": [4, 4, 4], "sparsity": s}`` (the same k; "legacy" passes the
                       sparsity that gives FastVideo's k); "auto" runs FA4 where it takes 64-slot blocks, else
                       compiled FlexAttention (the kernel is recorded);
* ``fastwan fa4``      the same with ``kernel="fa4"`` and the smallest block FA4 takes here (64 slots where the
                       installed flash_attn.cute takes explicit block sizes, else 128: half of it dummy slots);
* ``fastwan own``      the same sparsity on fastwan's own tiles (``"tile": "auto"``: 128-slot tiles fitted to the
                       grid), which a FastWan checkpoint cannot use (it was trained on 4x4x4 cubes): the speed of
                       fastwan's VSA where the tile is free (no selection or output comparison);
* ``dense FA4``, ``dense SDPA``  full attention on the raster tokens (``flash_attn.cute``; SDPA cudnn/flash).

Each sparsity row also records how many (head, query cube) rows select the same key cubes on both sides (FastVideo's
selection captured from one untimed call) and the largest output difference, raster order. The ratio printed is
FastVideo ms / fastwan ms (``fastvideo`` over each fastwan case; the JSON also has it for ``fastvideo kernel``).
A case that cannot run records why; cases left when ``--budget-s`` is spent are skipped (listed). The JSON
(``--out``) holds the environment, the arguments and every row; a short table is printed last. ``--dry-run`` (CI, no
GPU): the arguments checked and the (shape, sparsity, case) jobs listed with their k.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness import add_dry_run, print_plan
from fastwan.attention.base import AttentionMetadata
from fastwan.attention.registry import create_backend
from fastwan.attention.sparse.fa4 import fa4_reasons
from fastwan.attention.sparse.vsa import topk_count
from fastwan.attention.synthetic import wan_like_qkv
from fastwan.envinfo import device_info, software_versions
from fastwan.profiler import time_fn

CUBE = (4, 4, 4)
CUBE_TOKENS = 64
SHAPES = {  # label -> (token grid, heads)
    "1.3b-480p": ((21, 30, 52), 12),  # 81 x 480 x 832
    "1.3b-448p-61f": ((16, 28, 52), 12),  # 61 x 448 x 832
    "14b-720p": ((21, 45, 80), 40),  # 81 x 720 x 1280
}
FASTWAN = ("fastwan auto", "fastwan fa4", "fastwan own")
FASTVIDEO = ("fastvideo", "fastvideo kernel", "fastvideo layer")
DENSE = ("dense FA4", "dense SDPA")
CASES = FASTVIDEO + tuple(FASTWAN) + DENSE


# ---------------------------------------------------------------------------------------------- FastVideo
def cube_count(grid) -> int:
    return math.prod(-(-g // c) for g, c in zip(grid, CUBE))


def fastvideo_topk(sparsity: float, grid) -> int:
    """FastVideo's backend today (after its PR #1517): a share of all cubes, partial ones included, in [1, n]."""
    n = cube_count(grid)
    return max(1, min(math.ceil((1 - sparsity) * n), n))


def fastvideo_legacy_topk(sparsity: float, grid) -> int:
    """FastVideo's backend before PR #1517, which its FastWan checkpoints were trained with: a share of the real
    token count over 64 (no clamp)."""
    return math.ceil((1 - sparsity) * (math.prod(grid) / CUBE_TOKENS))


RULES = {"padded": fastvideo_topk, "legacy": fastvideo_legacy_topk}


def fastwan_sparsity(sparsity: float, grid, rule: str) -> float:
    """The sparsity that makes fastwan's ``topk_count`` give FastVideo's k under ``rule``."""
    if rule == "padded":
        return sparsity
    return 1 - RULES[rule](sparsity, grid) / cube_count(grid)


def fastvideo_kernel():
    """(the fastvideo_kernel module, None), or (None, why it cannot be used)."""
    try:
        import fastvideo_kernel
        from fastvideo_kernel import ops  # noqa: F401  (the module whose helpers fastvideo_spy wraps)
    except Exception as exc:  # ImportError, or a CUDA / Triton initialisation error
        return None, f"fastvideo_kernel does not import: {type(exc).__name__}: {exc}"
    if not hasattr(fastvideo_kernel, "build_vsa_metadata"):
        return None, f"fastvideo_kernel {getattr(fastvideo_kernel, '__version__', '?')} has no build_vsa_metadata"
    return fastvideo_kernel, None


def fastvideo_fine_path() -> str:
    """The block-sparse kernel ``video_sparse_attn`` takes here, by the package's own rule: the sm90
    ThunderKittens extension when it loads on an sm90 GPU (and FASTVIDEO_VSA_TRITON is not 1), else Triton."""
    try:  # the submodule (the package re-exports a function of the same name)
        bsa = importlib.import_module("fastvideo_kernel.block_sparse_attn")

        fwd, bwd = bsa._get_sm90_ops()
        if bsa._force_triton():
            return "triton (forced by FASTVIDEO_VSA_TRITON=1)"
        if bsa._is_sm90() and fwd is not None and bwd is not None:
            return "sm90 ThunderKittens extension"
    except Exception as exc:  # its private helpers moved
        return f"unknown ({type(exc).__name__}: {exc})"
    try:
        from fastvideo_kernel._C import fastvideo_kernel_ops  # noqa: F401

        why = "the extension loads, but this is no sm90 GPU"
    except Exception as exc:
        why = f"the extension does not load: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return f"triton ({why})"


class FastVideoVSA:
    """FastVideo's backend for one grid: the package's cube partition (``build_vsa_metadata``), q/k/v/gate
    scattered into a zero buffer of 64 slots per cube (real tokens first), ``video_sparse_attn`` on [B, H, S, D],
    and the gather back to raster order."""

    def __init__(self, fvk, grid, device):
        meta = fvk.build_vsa_metadata(tuple(grid), CUBE, torch.device(device))
        self.fvk = fvk
        self.buf = None  # the backend's per-step tile buffer (inference reuses it: padding stays zero)
        self.token_order = meta["tile_partition_indices"]  # raster index of each real token, cube by cube
        self.real_slots = meta["non_pad_index"]  # the slot of each of them in the padded buffer
        self.back = self.real_slots[meta["reverse_tile_partition_indices"]]  # raster token -> slot
        self.sizes = meta["variable_block_sizes"]  # real tokens per cube
        self.slots = self.sizes.numel() * CUBE_TOKENS

    def tile(self, x: torch.Tensor) -> torch.Tensor:
        """Raster [B, N, H, D] -> [B, slots, H, D], padding zero."""
        buf = x.new_zeros((x.shape[0], self.slots) + tuple(x.shape[2:]))
        buf[:, self.real_slots] = x[:, self.token_order]
        return buf

    def untile(self, y: torch.Tensor) -> torch.Tensor:
        return y[:, self.back]

    def kernel(self, q, k, v, gate, topk: int) -> torch.Tensor:
        """``video_sparse_attn`` on tiled [B, H, S, D] tensors."""
        return self.fvk.video_sparse_attn(q, k, v, self.sizes, self.sizes, topk, block_size=CUBE,
                                          compress_attn_weight=gate)

    def call_tiled(self, q, k, v, gate, topk: int) -> torch.Tensor:
        """What the backend's forward does: tiled [B, S, H, D] in, tiled [B, S, H, D] (a view) out."""
        q, k, v, gate = (t.transpose(1, 2).contiguous() for t in (q, k, v, gate))
        return self.kernel(q, k, v, gate, topk).transpose(1, 2)

    def __call__(self, q, k, v, gate, topk: int) -> torch.Tensor:
        """Raster [B, N, H, D] in and out, as its attention layer runs: q, k, v, gate concatenated along the batch,
        scattered into the reused zero-padded buffer, split, the backend's forward, untiled."""
        qkvg = torch.cat([q, k, v, gate], dim=0)
        if self.buf is None or self.buf.shape[0] != qkvg.shape[0] or self.buf.dtype != qkvg.dtype:
            self.buf = self.tile(qkvg)
        else:
            self.buf[:, self.real_slots] = qkvg[:, self.token_order]
        return self.untile(self.call_tiled(*self.buf.chunk(4, dim=0), topk))


@contextlib.contextmanager
def fastvideo_spy():
    """Record what ``video_sparse_attn`` computes on its way, by wrapping the helpers it calls from
    ``fastvideo_kernel.ops`` for the block: ``means`` (its bf16 cube means of q, k, v, in call order), ``scores``
    (bf16 cube scores), ``topk`` and ``mask`` (bool [B, H, n, n], the selected key cubes); the last call wins."""
    from fastvideo_kernel import ops

    seen: dict = {"means": []}
    mean_fn, topk_fn = ops.fused_block_mean, ops.fused_topk_mask

    def means(x, sizes, block_elements):
        out = mean_fn(x, sizes, block_elements)
        seen["means"] = (seen["means"] + [out.clone()])[-3:]
        return out

    def topk_mask(scores, topk):
        mask = topk_fn(scores, topk)
        seen.update(scores=scores.clone(), topk=topk, mask=mask.clone())
        return mask

    ops.fused_block_mean, ops.fused_topk_mask = means, topk_mask
    try:
        yield seen
    finally:
        ops.fused_block_mean, ops.fused_topk_mask = mean_fn, topk_fn


# ---------------------------------------------------------------------------------------------- fastwan, dense
def fastwan_configs() -> dict:
    """Case -> config on top of ``{"tile": [4, 4, 4], "sparsity": s}``: kernel auto; kernel fa4 with the
    smallest block FA4 block sparsity takes here (64 slots where the installed flash_attn.cute takes explicit
    block sizes, else 128: 64 tokens and 64 dummy slots per block); and fastwan's own tiles (``"auto"``: 128-slot
    tiles fitted to the grid; other cubes than FastVideo's, so neither its selection nor its output compare)."""
    from fastwan.attention.sparse import fa4

    multiple = getattr(fa4, "fa4_block_multiple", lambda: 128)()
    return {"fastwan auto": {}, "fastwan fa4": {"kernel": "fa4", "block_size": max(64, multiple)},
            "fastwan own": {"tile": "auto"}}


class FastwanVSA:
    """fastwan's backend as for a FastWan checkpoint, its inputs permuted into its layout once."""

    def __init__(self, conf: dict, grid, sparsity: float, q, k, v, gate):
        self.backend = create_backend("VIDEO_SPARSE_ATTN", {"tile": list(CUBE), "sparsity": sparsity, **conf})
        self.layout = self.backend.layout(grid, q.device)
        self.sparsity = sparsity
        self.q, self.k, self.v, self.gate = (self.layout.permute(t, dim=1) for t in (q, k, v, gate))
        self.meta = AttentionMetadata(grid=tuple(grid), step_index=0, num_steps=1, layer_index=0, layout=self.layout,
                                      extra={"gate_compress": self.gate})

    def kernel_name(self) -> str:
        return self.backend.kernel_name(self.q.device)

    def __call__(self) -> torch.Tensor:
        return self.backend(self.q, self.k, self.v, meta=self.meta)

    def selection(self) -> torch.Tensor:
        """bool [B, H, n, n]: the key cubes of every query cube (``select`` is deterministic: the call's choice)."""
        plan, _ = self.backend.select(self.q, self.k, self.v, self.layout, self.q.shape[-1] ** -0.5, self.sparsity)
        return plan.any

    def raster(self, out: torch.Tensor) -> torch.Tensor:
        return self.layout.unpermute(out, dim=1)


def dense_fn(label: str, q, k, v):
    """fn() -> out for a dense case; raises when it cannot run here."""
    if label == "dense FA4":
        from flash_attn.cute import flash_attn_func

        def fa4():
            out = flash_attn_func(q, k, v)
            return out[0] if isinstance(out, tuple) else out

        return fa4
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)

    return sdpa


# ---------------------------------------------------------------------------------------------- timing
def timed(row: dict, fn, warmup: int, iters: int):
    """Fill ``row`` with first_call_s, ms (median of ``iters`` CUDA-event timed calls after ``warmup``) and
    times_ms; returns the first call's output."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    row["first_call_s"] = round(time.perf_counter() - t0, 3)
    times = time_fn(fn, warmup=warmup, iters=iters, device=torch.device("cuda"))
    row["ms"] = round(statistics.median(times), 4)
    row["times_ms"] = [round(t, 4) for t in times]
    return out


def guarded(row: dict, work, *args) -> object:
    """``work(*args)``; an exception becomes ``row["error"]`` and None is returned (the run goes on)."""
    try:
        return work(*args)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        torch.cuda.empty_cache()
        return None


def bench_sparsity(shape, grid, heads, sparsity, rule, qkvg, cases, fvk, fvk_why, args) -> list[dict]:
    """The rows of one (shape, sparsity): FastVideo's cases, fastwan's, then the comparison figures."""
    q, k, v, gate = qkvg
    topk = RULES[rule](sparsity, grid)
    fw_sparsity = fastwan_sparsity(sparsity, grid, rule)
    base = {"shape": shape, "grid": list(grid), "heads": heads, "sparsity": sparsity, "k_rule": rule, "k": topk,
            "cubes": cube_count(grid)}
    rows, fv_out, fv_mask = [], None, None
    fv = FastVideoVSA(fvk, grid, q.device) if fvk is not None else None
    if fv is not None:
        tiled = [fv.tile(t) for t in (q, k, v, gate)]
        bhsd = [t.transpose(1, 2).contiguous() for t in tiled]
        fns = {"fastvideo": lambda: fv.call_tiled(*tiled, topk), "fastvideo kernel": lambda: fv.kernel(*bhsd, topk),
               "fastvideo layer": lambda: fv(q, k, v, gate, topk)}
        with torch.inference_mode(), fastvideo_spy() as seen:  # one untimed call: output and selection
            fv_out = guarded(base.copy(), fns["fastvideo layer"])
        fv_mask = seen.get("mask")
    for case in (c for c in FASTVIDEO if c in cases):
        row = {**base, "case": case, "kernel": fastvideo_fine_path() if fv is not None else None}
        rows.append(row)
        if fv is None:
            row["error"] = fvk_why
            continue
        with torch.inference_mode():
            guarded(row, timed, row, fns[case], args.warmup, args.iters)
    if fv is not None:
        del tiled, bhsd, fns
    configs = fastwan_configs()
    for case in (c for c in FASTWAN if c in cases):
        row = {**base, "case": case, "fastwan_sparsity": fw_sparsity, "config": configs[case]}
        rows.append(row)
        if configs[case].get("kernel") == "fa4" and fa4_reasons(q.device, q.dtype):
            row["error"] = "cannot run: " + "; ".join(fa4_reasons(q.device, q.dtype))
            continue
        fw = guarded(row, FastwanVSA, configs[case], grid, fw_sparsity, q, k, v, gate)
        if fw is None:
            continue
        row["kernel"] = fw.kernel_name()
        with torch.inference_mode():
            out = guarded(row, timed, row, fw, args.warmup, args.iters)
            own = "tile" in configs[case]  # other cubes: a different selection and output by design
            if out is not None and fv_out is not None and not own:
                row["max_abs_diff_vs_fastvideo"] = float((fw.raster(out).float() - fv_out.float()).abs().max())
            if out is not None and fv_mask is not None and not own:
                same = (fw.selection() == fv_mask).all(-1)
                row["selection_rows_same_as_fastvideo"] = round(float(same.float().mean()), 4)
        del fw, out
        torch.cuda.empty_cache()
    by = {r["case"]: r for r in rows}
    for name in FASTWAN:
        for fvc in ("fastvideo", "fastvideo kernel"):
            a, b = by.get(fvc, {}), by.get(name, {})
            if a.get("ms") and b.get("ms"):
                b[f"ratio_{fvc.replace(' ', '_')}"] = round(a["ms"] / b["ms"], 2)
    return rows


def row_line(r: dict) -> str:
    if "error" in r:
        return f"  {r['case']:18s} ERROR {r['error'][:150]}"
    extra = "".join(f", {key} {r[key]}" for key in ("ratio_fastvideo", "selection_rows_same_as_fastvideo",
                                                     "max_abs_diff_vs_fastvideo") if key in r)
    kernel = str(r.get("kernel"))[:70]
    return f"  {r['case']:18s} {r['ms']:9.3f} ms (first call {r['first_call_s']:.1f} s; {kernel}){extra}"


def print_table(rows: list[dict]) -> None:
    """One line per (shape, sparsity): ms of each case and FastVideo / fastwan."""
    keys = sorted({(r["shape"], r["sparsity"]) for r in rows if "sparsity" in r},
                  key=lambda x: (list(SHAPES).index(x[0]), x[1]))
    cols = ["fastvideo", "fastvideo kernel", *FASTWAN, *DENSE]
    hdr = f"{'shape':14s} {'s':>4s} {'k':>4s}" + "".join(f"{c:>17s}" for c in cols) + \
        f"{'FV/auto':>9s}{'FV/fa4':>8s}{'FV/own':>8s}{'same sel':>9s}"
    print(hdr + "\n" + "-" * len(hdr))
    for shape, s in keys:
        rs = {r["case"]: r for r in rows if r["shape"] == shape and (r.get("sparsity") in (s, None))}
        k = next((r["k"] for r in rs.values() if "k" in r), "")
        cells = [f"{rs[c]['ms']:.3f}" if rs.get(c, {}).get("ms") else "n/a" for c in cols]
        ratios = [rs.get(n, {}).get("ratio_fastvideo") for n in FASTWAN]
        same = rs.get("fastwan auto", {}).get("selection_rows_same_as_fastvideo")
        print(f"{shape:14s} {s:>4.2f} {k:>4}" + "".join(f"{c:>17s}" for c in cells)
              + "".join(f"{(f'{x:.2f}x' if x else 'n/a'):>{w}s}" for x, w in zip(ratios, (9, 8, 8)))
              + f"{(f'{same:.1%}' if same is not None else 'n/a'):>9s}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vsa_fastvideo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--iters", type=int, default=20, help="timed calls per case (median; at least 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--sparsity", default="0.8,0.9", help="comma-separated VSA sparsities")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of: {', '.join(CASES)}")
    p.add_argument("--k-rule", choices=sorted(RULES), default="padded",
                   help="FastVideo's k: padded = its backend today, legacy = what FastWan was trained with")
    p.add_argument("--budget-s", type=float, default=480.0, help="skip the (shape, sparsity) pairs left after this")
    add_dry_run(p)
    return p


def plan(shapes: list[str], sparsities: list[float], cases: list[str], rule: str) -> list[str]:
    """The jobs of a run: each shape's dense cases, then each (shape, sparsity)'s sparse cases with FastVideo's k
    under ``rule`` and the sparsity fastwan runs to get it."""
    jobs = []
    for shape in shapes:
        grid, heads = SHAPES[shape]
        head = f"{shape} ({'x'.join(map(str, grid))}, {heads} heads, {cube_count(grid)} cubes)"
        jobs += [f"{head}: {case}" for case in DENSE if case in cases]
        for s in sparsities:
            k, fw = RULES[rule](s, grid), fastwan_sparsity(s, grid, rule)
            jobs += [f"{head}, sparsity {s} (k {k}, fastwan at {fw:.4f}): {case}" for case in cases
                     if case not in DENSE]
    return jobs


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}; choose from {', '.join(CASES)}")
    try:
        sparsities = [float(x) for x in args.sparsity.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sparsity {args.sparsity!r}: use numbers in [0, 1), e.g. 0.8,0.9")
    if not sparsities or any(not 0 <= s < 1 for s in sparsities):
        ap.error(f"--sparsity {args.sparsity!r}: use numbers in [0, 1), e.g. 0.8,0.9")
    if args.iters < 10:
        ap.error("--iters must be at least 10")
    if args.dry_run:
        return print_plan(ap.prog, plan(shapes, sparsities, cases, args.k_rule))
    if not torch.cuda.is_available():
        print("vsa_fastvideo needs a CUDA device", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    fvk, fvk_why = fastvideo_kernel()
    env = {"device": device_info(), "software": software_versions(),
           "fastvideo_kernel": getattr(fvk, "__version__", None) if fvk else fvk_why,
           "fastvideo_fine_kernel": fastvideo_fine_path() if fvk else None,
           "fa4_block_sparse": fa4_reasons("cuda", torch.bfloat16) or "ok"}
    print(json.dumps({k: env[k] for k in ("fastvideo_kernel", "fastvideo_fine_kernel", "fa4_block_sparse")}),
          flush=True)
    rows, skipped = [], []
    for shape in shapes:
        grid, heads = SHAPES[shape]
        if time.perf_counter() - t_start > args.budget_s:
            skipped += [f"{shape}/s={s}" for s in sparsities]
            continue
        q, k, v = wan_like_qkv(grid, heads, 128, dtype=torch.bfloat16, device="cuda", seed=0)
        gen = torch.Generator(device="cuda").manual_seed(1)
        gate = torch.randn(q.shape, device="cuda", generator=gen).to(torch.bfloat16)
        print(f"== {shape}: grid {'x'.join(map(str, grid))} ({math.prod(grid)} tokens, {cube_count(grid)} cubes), "
              f"{heads} heads, D=128, bf16", flush=True)
        for case in (c for c in DENSE if c in cases):
            row = {"shape": shape, "grid": list(grid), "heads": heads, "case": case}
            with torch.inference_mode():
                fn = guarded(row, dense_fn, case, q, k, v)
                if fn is not None:
                    guarded(row, timed, row, fn, args.warmup, args.iters)
            rows.append(row)
            print(row_line(row), flush=True)
        for s in sparsities:
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append(f"{shape}/s={s}")
                continue
            print(f"-- sparsity {s} (k rule {args.k_rule}: k = {RULES[args.k_rule](s, grid)} of "
                  f"{cube_count(grid)}; fastwan's topk_count at the sparsity it gets: "
                  f"{topk_count(fastwan_sparsity(s, grid, args.k_rule), cube_count(grid))})", flush=True)
            new = bench_sparsity(shape, grid, heads, s, args.k_rule, (q, k, v, gate), cases, fvk, fvk_why, args)
            rows += new
            for r in new:
                print(row_line(r), flush=True)
        del q, k, v, gate
        torch.cuda.empty_cache()
    report = {"env": env, "args": vars(args), "rows": rows, "skipped_for_budget": skipped,
              "wall_s": round(time.perf_counter() - t_start, 1)}
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(f"\n{env['device'].get('name')} | torch {torch.__version__} | fastvideo_kernel {env['fastvideo_kernel']} | "
          f"FastVideo fine kernel: {env['fastvideo_fine_kernel']} | wrote {args.out}; skipped: {skipped or 'none'}")
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
