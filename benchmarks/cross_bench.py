"""Cross-attention kernels at the Wan shapes: q [B, S, H, 128] against the 512 text keys/values [B, 512, H, 128].

    python -m benchmarks.cross_bench [--prompt-tokens 20,8,150] [--quick]

FA4 (flash_attn.cute) with several sm90 tiles, and PyTorch SDPA with cuDNN, FA2 and the memory-efficient kernel;
per case 3 rounds of 50 back-to-back calls between two CUDA events (median), and the max difference against the
first kernel's output. The text keys/values are padded as Wan pads them: ``--prompt-tokens`` real rows, then
copies of one padding row. q is RMS-normalised over all heads (as the block's ``norm_q``) before the other
kernels; "collapsed" is fastwan's kernel for that case (``fastwan::text_cross_attention_normq``: the padding as
one weighted key, :mod:`fastwan.kernels.text_cross`), which takes the raw q and normalises it inside, so its time
includes that norm. ``--quick``: FA4 192x128 and 128x128, cuDNN and the collapsed kernel only. Needs a GPU with
flash-attn-4 installed.

``--fold`` times instead the whole cross-attention after the q projection, as the block runs it with the residual
adds in the GEMMs: unfolded (``text_cross_attention_normq`` + the output projection added into x,
``residual_linear_``) against folded (``text_cross_probs_normq`` + ``residual_bmm_`` with the per-prompt
``fold_values``), at the width ``fold_width`` would give without its limit (to find where the fold pays), up to
the probs kernel's ``MAX_WIDTH``. ``--dry-run`` (CI, no GPU): the arguments checked and the jobs listed.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import harness
from benchmarks.harness import add_dry_run, print_plan

SHAPES = [(1, 32760, 12), (2, 32760, 12), (1, 75600, 40)]  # 1.3B 480p (B=1, B=2), 14B 720p
FA4_TILES = [(128, 128, True), (192, 128, False), (128, 176, True), (64, 128, True), (128, 64, True),
             (192, 64, False)]  # (tile_m, tile_n, mma_pv_is_rs)
SDPA = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


def span_ms(fn) -> float:
    """Median over 3 rounds of the ms per call of 50 back-to-back calls (one span, CUDA events)."""
    return harness.span_ms(fn, calls=50, rounds=3)


def fold_width(tokens: int) -> int:
    """The folded values' width for a prompt of ``tokens`` real tokens (as ``fold_width`` gives it, without its
    limit): the real rows and the one padding key, rounded up to ``FOLD_ALIGN``."""
    from fastwan.models.wan.cross import FOLD_ALIGN

    return -(-min(tokens + 1, 512) // FOLD_ALIGN) * FOLD_ALIGN


def plan(a, tokens: list[int]) -> list[str]:
    """The jobs of a run: each (shape, prompt tokens) with its kernels, or (``--fold``) its width."""
    from fastwan.kernels.text_cross import MAX_WIDTH

    tiles, sdpa_list = kernels(a.quick)
    names = [f"fa4 {tm}x{tn}{' rs' if rs else ''}" for tm, tn, rs in tiles] + [n for n, _ in sdpa_list]
    jobs = []
    for (b, n, h), t in ((s, t) for s in SHAPES for t in tokens):
        if not a.fold:
            jobs.append(f"{b}x{n}x{h}, {t} prompt tokens: {', '.join(names)}, collapsed")
        elif fold_width(t) > MAX_WIDTH:
            jobs.append(f"{b}x{n}x{h}, {t} prompt tokens: width {fold_width(t)} > {MAX_WIDTH}, skipped")
        else:
            jobs.append(f"{b}x{n}x{h}, {t} prompt tokens: unfolded vs folded at width {fold_width(t)}")
    return jobs


def kernels(quick: bool) -> tuple[list, list]:
    """(FA4 tiles, SDPA kernels) of a run (``--quick``: two tiles and cuDNN)."""
    tiles = [t for t in FA4_TILES if t[:2] in ((192, 128), (128, 128))] if quick else FA4_TILES
    return tiles, SDPA[:1] if quick else SDPA


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cross_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", default="20", help="real text tokens per case (0..512), comma-separated")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--fold", action="store_true", help="time the folded output projection against the unfolded")
    add_dry_run(p)
    a = p.parse_args(argv)
    try:
        counts = [int(t) for t in a.prompt_tokens.split(",")]
    except ValueError:
        counts = [-1]
    if any(not 0 <= t <= 512 for t in counts):
        p.error(f"--prompt-tokens {a.prompt_tokens!r}: use integers 0..512, comma-separated, e.g. 20,150")
    if a.dry_run:
        return print_plan(p.prog, plan(a, counts))
    if a.fold:
        return fold_main(counts)
    from flash_attn.cute.interface import _flash_attn_fwd

    import fastwan.kernels.text_cross  # noqa: F401  (registers fastwan::text_cross_attention_normq)

    tiles, sdpa_list = kernels(a.quick)
    for (b, n, h), tokens in ((s, t) for s in SHAPES for t in counts):
        g = torch.Generator(device="cuda").manual_seed(0)
        raw = torch.randn(b, n, h * 128, device="cuda", dtype=torch.bfloat16, generator=g)  # q before its norm
        ones = torch.ones(h * 128, device="cuda", dtype=torch.bfloat16)
        q = F.rms_norm(raw, (h * 128,), eps=1e-6).view(b, n, h, 128)  # what the collapsed kernel attends with
        k, v = (torch.randn(b, 512, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k[:, tokens:], v[:, tokens:] = k[:, tokens:tokens + 1].clone(), v[:, tokens:tokens + 1].clone()
        keys = torch.full((b,), min(tokens + 1, 512), device="cuda", dtype=torch.int32)
        flops = 4 * b * h * n * 512 * 128
        fns = {}
        for tm, tn, rs in tiles:
            fns[f"fa4 {tm}x{tn}{' rs' if rs else ''}"] = lambda tm=tm, tn=tn, rs=rs, qkv=(q, k, v): _flash_attn_fwd(
                *qkv, softmax_scale=128 ** -0.5, tile_mn=(tm, tn), mma_pv_is_rs=rs, intra_wg_overlap=True)[0]
        for name, be in sdpa_list:
            def sdpa(be=be, qkv=(q, k, v)):
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in qkv)).transpose(1, 2)
            fns[name] = sdpa
        fns["collapsed"] = lambda args=(raw, ones, 1e-6, k, v, keys): torch.ops.fastwan.text_cross_attention_normq(
            *args)
        ref = None
        for name, fn in fns.items():
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # a tile the kernel cannot build, a backend PyTorch refuses
                print(f"{b}x{n}x{h} {tokens} tok {name}: cannot run ({type(exc).__name__}: {str(exc)[:100]})")
                continue
            ref = out if ref is None else ref
            ms = span_ms(fn)
            err = float((out.float() - ref.float()).abs().max())
            print(f"{b}x{n}x{h} {tokens:3d} tok {name:18s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  "
                  f"max diff {err:.1e}", flush=True)
    return 0


def fold_main(tokens: list[int]) -> int:
    print(f"{'shape':<14} {'tok':>4} {'width':>5} {'unfolded us':>12} {'folded us':>10} {'ratio':>6} {'rel diff':>9}")
    for (b, n, h), t in ((s, t) for s in SHAPES for t in tokens):
        fold_case(b, n, h, t)
    return 0


def fold_case(b: int, n: int, h: int, tokens: int) -> None:
    from fastwan.kernels import norms as fused  # noqa: F401  (registers fastwan::residual_linear_ / residual_bmm_)
    from fastwan.kernels import text_cross
    from fastwan.models.wan.cross import fold_values

    ops = torch.ops.fastwan
    c = h * 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, n, c, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.rand(c, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    k, v = (torch.randn(b, 512, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k[:, tokens:], v[:, tokens:] = k[:, tokens:tokens + 1].clone(), v[:, tokens:tokens + 1].clone()
    keys = torch.full((b,), min(tokens + 1, 512), device="cuda", dtype=torch.int32)
    wo = torch.randn(c, c, device="cuda", dtype=torch.bfloat16, generator=g) * c ** -0.5
    x0 = torch.randn(b, n, c, device="cuda", dtype=torch.bfloat16, generator=g)
    width = fold_width(tokens)
    if width > text_cross.MAX_WIDTH:
        return
    u = fold_values(v, keys, width, wo)
    xa, xb = x0.clone(), x0.clone()

    def unfolded():
        ops.residual_linear_(xa, ops.text_cross_attention_normq(q, w, 1e-6, k, v, keys).flatten(2), wo)

    def folded():
        ops.residual_bmm_(xb, ops.text_cross_probs_normq(q, w, 1e-6, k, keys, width).flatten(2), u)

    unfolded(), folded()
    d = xa.float() - x0.float()
    rel = float((xb.float() - xa.float()).norm() / d.norm())
    ta, tb = span_ms(unfolded), span_ms(folded)
    print(f"{b}x{n}x{h:<4} {tokens:>4} {width:>5} {ta * 1e3:>12.1f} {tb * 1e3:>10.1f} {tb / ta:>6.3f} {rel:>9.2e}",
          flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
