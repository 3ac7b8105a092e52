"""fastwan's VIDEO_SPARSE_ATTN against FastVideo's VSA (``fastvideo-kernel`` 0.3.5) on the same inputs (CUDA).

    pip install --no-deps fastvideo_kernel-0.3.5-cp312-*.whl   # --no-deps: the wheel pins torch==2.12.0
    python -m pytest -q -s tests/gpu/test_gpu_vsa_fastvideo.py  # -s prints the figures of every case

Skipped unless CUDA is available and ``fastvideo_kernel`` imports.

FastVideo is called as its backend (``fastvideo/attention/backends/video_sparse_attn.py``) calls it
(:class:`benchmarks.vsa_fastvideo.FastVideoVSA`): the package's ``build_vsa_metadata`` partitions the raster
tokens into 4x4x4 cubes (raster order of the cube grid; cubes on the far faces of a grid 4 does not divide hold
fewer tokens), q, k, v and the gate are scattered into a zero buffer of 64 slots per cube (real tokens first),
transposed to [B, H, S, D] for ``video_sparse_attn(q, k, v, sizes, sizes, topk, block_size=(4, 4, 4),
compress_attn_weight=gate)``, and gathered back. ``topk``: rule "padded" is its backend's today,
``clamp(ceil((1 - s) * n_cubes), 1, n)``; rule "legacy" the one before its PR #1517 (July 2026), which the FastWan
checkpoints were trained with, ``ceil((1 - s) * T*H*W / 64)``: smaller on grids 4 does not divide (480p, s = 0.8:
103 of 624 cubes instead of 125). fastwan takes no k: it gets sparsity ``1 - k / n``, which ``topk_count`` turns
back into k (checked). Inside ``video_sparse_attn``: bf16 cube means (fp32 sum of all 64 slots / real count,
written as bf16), bf16 scores (bf16 matmul, then / sqrt(D) in bf16), per query cube the k largest scores (ties to
the lower index), block-sparse attention over the selected cubes' real tokens (the sm90 extension when it loads,
else the package's Triton kernel, by its own rule; printed), output ``coarse * gate + fine`` with the bf16 coarse
output repeated over each cube. fastwan runs as for a FastWan checkpoint, ``{"tile": [4, 4, 4], "sparsity": s}``
(kernel "auto"; also "fa4", 64 or 128 slots per cube, where FA4 block sparsity runs), which on bf16 inputs ranks
cubes by FastVideo's rule (bf16 means, bf16 scores divided by sqrt(D), ties to the lower index).

Compared per case (grid, heads, batch, sparsity, k rule):

1. FastVideo's intermediates, captured from the real call (``fastvideo_spy`` wraps the package's
   ``fused_block_mean`` and ``fused_topk_mask``): k cubes per row; its means = the means over real tokens rounded
   to bf16 (but for rare last-bit flips of the fp32 summation order); its scores = ``matmul(means) / sqrt(D)`` in
   bf16, bit for bit; its mask = the k largest of its scores, ties to the lower index. This pins its rule down.
2. ``test_selection_identical_to_fastvideo`` (strict): fastwan keeps FastVideo's key cubes in every (batch, head,
   query cube) row. (Ranking fp32 scores instead picks differently wherever the k-th and (k+1)-th scores are
   closer than bf16 resolution: at 480p a quarter of the rows, changing those tokens' outputs by 10-15x the
   tolerance.)
3. ``test_selection_differs_only_at_rounding_ties``: same k, and every cube kept by one side only scores (exact
   fp64 score of the bf16 inputs) within twice FastVideo's own score error of the k-th best: a wrong k, pooling
   over padding, a wrong scale or cube order fails it; fastwan = the bf16-score rule computed here, up to such
   ties (the last-bit order of the fp32 sums behind the means).
4. ``test_outputs_match_reference``: an fp32 reference built here on raster tokens (cube means -> scores -> top-k
   -> attention over the selected cubes' real tokens + coarse attention over cube means * gate), on sampled query
   cubes (all on small grids; the corner cubes always): FastVideo under its captured selection and under the
   bf16-score rule, fastwan under its selection and the exact-score rule (rows where selection = rule), FastVideo
   vs fastwan where both chose the same cubes (2x the tolerance); per element within ``ATOL + RTOL * (|fine| +
   |coarse * gate|)`` (both round the two terms and their sum to bf16, the kernels round P to bf16, FastVideo's
   coarse branch is bf16 throughout: an emulation of it used a third of the bound, fastwan's CPU bf16 path 0.37).
   The reference must differ from the one keeping every cube by > 5 ATOL, so ignoring the selection would fail.

Inputs: Wan-like bf16 q, k, v (``fastwan.attention.synthetic.wan_like_qkv``) and an N(0, 1) bf16 gate; grids
8x12x16 (4 divides it), 5x10x14 (cubes of 4 to 64 real tokens) and 1.3B 480p 21x30x52 with 12 heads; D = 128.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch

from benchmarks.vsa_fastvideo import (RULES, FastVideoVSA, FastwanVSA, cube_count, fastvideo_fine_path,
                                      fastvideo_kernel, fastvideo_spy, fastvideo_topk, fastwan_configs)
from fastwan.attention.sparse import fa4
from fastwan.attention.sparse.vsa import topk_count
from fastwan.attention.synthetic import wan_like_qkv

CUBE = (4, 4, 4)
HEAD_DIM = 128
ATOL, RTOL = 2e-2, 2e-2  # output vs fp32 reference, per element (see the module docstring)
SAMPLED_CUBES = 48  # query cubes the fp32 reference evaluates on large grids

_FVK, _FVK_WHY = fastvideo_kernel() if torch.cuda.is_available() else (None, "needs a CUDA device")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(_FVK is None, reason=_FVK_WHY or ""),
]


def run_fastvideo(grid, q, k, v, gate, topk):
    """(raster output, what the spy saw, fine-kernel path). If the sm90 extension's call fails, it is repeated on
    the package's Triton path (``FASTVIDEO_VSA_TRITON=1``, the switch the package reads on every call)."""
    fv = FastVideoVSA(_FVK, grid, q.device)
    path = fastvideo_fine_path()
    with torch.inference_mode():
        try:
            with fastvideo_spy() as seen:
                out = fv(q, k, v, gate, topk)
            torch.cuda.synchronize()
        except Exception as exc:
            if not path.startswith("sm90"):
                raise
            os.environ["FASTVIDEO_VSA_TRITON"] = "1"
            path = f"triton (the sm90 call failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
            with fastvideo_spy() as seen:
                out = fv(q, k, v, gate, topk)
    if "mask" not in seen or len(seen["means"]) != 3:
        pytest.fail("video_sparse_attn no longer calls fastvideo_kernel.ops' helpers as 0.3.5 did: update the spy")
    return out, seen, path


def run_fastwan(conf: dict, grid, q, k, v, gate, sparsity):
    """(raster output, selection bool [B, H, n, n]) of the backend configured as for a FastWan checkpoint."""
    fw = FastwanVSA(conf, grid, sparsity, q, k, v, gate)
    with torch.inference_mode():
        out = fw()
        chosen = fw.selection().clone()
    return fw.raster(out), chosen


# ------------------------------------------------------------------------------------------ the rule, raster order
def cube_of_token(grid, device) -> torch.Tensor:
    """long [T*H*W]: the cube (raster order of the cube grid) of every raster token."""
    T, H, W = grid
    nh, nw = -(-H // CUBE[1]), -(-W // CUBE[2])
    t = torch.arange(T, device=device)[:, None, None] // CUBE[0]
    h = torch.arange(H, device=device)[None, :, None] // CUBE[1]
    w = torch.arange(W, device=device)[None, None, :] // CUBE[2]
    return ((t * nh + h) * nw + w).flatten()


def cube_means(x: torch.Tensor, cube: torch.Tensor, n: int) -> torch.Tensor:
    """Mean over each cube's tokens: raster [B, N, H, D] -> fp32 [B, H, n, D] (fp64 sums)."""
    B, _, H, D = x.shape
    sums = torch.zeros(B, n, H, D, dtype=torch.float64, device=x.device).index_add_(1, cube, x.double())
    count = torch.bincount(cube, minlength=n).double()
    return (sums / count[None, :, None, None]).float().transpose(1, 2)


def exact_scores(qc, kc) -> torch.Tensor:
    """fp64 [B, H, n, n] cube scores of fp32 cube means, scaled by 1/sqrt(D)."""
    return torch.matmul(qc.double(), kc.double().transpose(-1, -2)) * qc.shape[-1] ** -0.5


def bf16_scores(qc, kc) -> torch.Tensor:
    """bf16 [B, H, n, n] cube scores as FastVideo forms them: bf16 means, bf16 matmul, divided by sqrt(D) in bf16."""
    q16, k16 = (t.to(torch.bfloat16).contiguous() for t in (qc, kc))  # contiguous, as FastVideo's kernel writes them
    return torch.matmul(q16, k16.transpose(-1, -2)) / qc.shape[-1] ** 0.5


def top_cubes(scores: torch.Tensor, k: int) -> torch.Tensor:
    """bool [..., n]: the k largest entries of every row, ties to the lower index."""
    order = torch.sort(scores.double(), dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, order, True)


def reference_rows(q, k, v, gate, cube, n, chosen, query_cubes):
    """fp32 VSA output of the tokens of ``query_cubes`` under the cube selection ``chosen`` bool [B, H, n, n]:
    attention over the real tokens of the selected key cubes ("fine") plus the coarse (cube-mean) attention output
    times the gate. -> (raster token indices [r], output fp32 [B, r, H, D], |fine| + |coarse * gate| fp32
    [B, r, H, D], the magnitude that bf16 rounding of the two terms and their sum is relative to)."""
    B, N, H, D = q.shape
    scale = D ** -0.5
    rows = torch.nonzero(torch.isin(cube, query_cubes)).flatten()
    qc, kc, vc = (cube_means(t, cube, n) for t in (q, k, v))
    coarse = torch.matmul(torch.softmax(exact_scores(qc, kc).float(), dim=-1), vc)  # [B, H, n, D]
    out = torch.empty(B, rows.numel(), H, D, dtype=torch.float32, device=q.device)
    mag = torch.empty_like(out)
    for b in range(B):
        for h in range(H):
            s = (q[b, rows, h].float() @ k[b, :, h].float().T) * scale  # [r, N]
            allowed = chosen[b, h][cube[rows]][:, cube]
            s = s.masked_fill(~allowed, float("-inf"))
            fine = torch.softmax(s, dim=-1) @ v[b, :, h].float()
            gated = coarse[b, h][cube[rows]] * gate[b, rows, h].float()
            out[b, :, h] = fine + gated
            mag[b, :, h] = fine.abs() + gated.abs()
    return rows, out, mag


def sampled_query_cubes(grid, n, device, count=SAMPLED_CUBES) -> torch.Tensor:
    """All cubes of a small grid; else the first cube, the corner cubes of the far faces and random others."""
    if n <= count:
        return torch.arange(n, device=device)
    nt, nh, nw = (-(-g // c) for g, c in zip(grid, CUBE))
    corners = {((a * nh) + b) * nw + c for a in (0, nt - 1) for b in (0, nh - 1) for c in (0, nw - 1)}
    g = torch.Generator().manual_seed(0)
    rest = [int(i) for i in torch.randperm(n, generator=g) if int(i) not in corners][: count - len(corners)]
    return torch.tensor(sorted(corners | set(rest)), device=device)


def near_ties(exact: torch.Tensor, k: int, slack: torch.Tensor) -> torch.Tensor:
    """bool [..., n]: entries whose exact score is within ``slack`` ([..., 1]) of the row's k-th best."""
    kth = exact.topk(k, dim=-1).values[..., -1:]
    return (exact - kth).abs() <= slack


# ------------------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    id: str
    grid: tuple
    heads: int
    batch: int
    sparsity: float
    rule: str = "padded"


CASES = [
    *(Case(f"small-8x12x16-s{s}", (8, 12, 16), 4, 2, s) for s in (0.8, 0.9)),
    *(Case(f"odd-5x10x14-s{s}", (5, 10, 14), 4, 2, s) for s in (0.8, 0.9)),
    *(Case(f"wan1.3b-480p-s{s}", (21, 30, 52), 12, 1, s) for s in (0.8, 0.9)),
]
FASTWAN_KERNELS = ("auto", "fa4")  # configs: benchmarks.vsa_fastvideo.fastwan_configs


@dataclass
class Run:
    case: Case
    n: int
    k: int
    fw_sparsity: float
    q: torch.Tensor
    kk: torch.Tensor
    v: torch.Tensor
    gate: torch.Tensor
    cube: torch.Tensor
    fv_out: torch.Tensor  # raster [B, N, H, D]
    fv: dict  # what fastvideo_spy saw
    fv_path: str
    fw: dict  # fastwan kernel -> (raster output, selection bool [B, H, n, n])
    skipped: dict = field(default_factory=dict)  # fastwan kernel -> why it cannot run here
    _refs: dict = field(default_factory=dict)

    @property
    def fw_chosen(self) -> torch.Tensor:
        """fastwan's selection (the same for every kernel: checked in test_fastwan_kernels_select_alike)."""
        return next(iter(self.fw.values()))[1]

    def reference(self, name: str, chosen: torch.Tensor, query_cubes: torch.Tensor):
        if name not in self._refs:
            self._refs[name] = reference_rows(self.q, self.kk, self.v, self.gate, self.cube, self.n, chosen,
                                              query_cubes)
        return self._refs[name]


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def run(request):
    case: Case = request.param
    grid, dev = case.grid, torch.device("cuda")
    n = cube_count(grid)
    k = RULES[case.rule](case.sparsity, grid)
    fw_sparsity = case.sparsity if case.rule == "padded" else 1 - k / n
    q, kk, v = wan_like_qkv(grid, case.heads, HEAD_DIM, batch=case.batch, dtype=torch.bfloat16, device=dev, seed=0)
    g = torch.Generator(device=dev).manual_seed(1)
    gate = torch.randn(q.shape, device=dev, generator=g).to(torch.bfloat16)
    fv_out, seen, path = run_fastvideo(grid, q, kk, v, gate, k)
    fw, skipped = {}, {}
    for name in FASTWAN_KERNELS:
        conf = fastwan_configs()[f"fastwan {name}"]
        if conf.get("kernel") == "fa4" and fa4.fa4_reasons(dev, torch.bfloat16):
            skipped[name] = "; ".join(fa4.fa4_reasons(dev, torch.bfloat16))
            continue
        fw[name] = run_fastwan(conf, grid, q, kk, v, gate, fw_sparsity)
    print(f"\n[{case.id}] grid {list(grid)} heads {case.heads} batch {case.batch}: {n} cubes, k={k} "
          f"({case.rule} rule; fastwan sparsity {fw_sparsity:.6g}); FastVideo fine kernel: {path}")
    r = Run(case, n, k, fw_sparsity, q, kk, v, gate, cube_of_token(grid, dev), fv_out, seen, path, fw, skipped)
    yield r
    del r
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ 1. FastVideo's rule
def test_k_per_query_cube(run):
    """FastVideo keeps k cubes per row, fastwan's topk_count gives the same k from its sparsity."""
    assert run.fv["topk"] == run.k
    assert torch.equal(run.fv["mask"].sum(-1), torch.full_like(run.fv["mask"].sum(-1), run.k, dtype=torch.long))
    assert topk_count(run.fw_sparsity, run.n) == run.k
    assert torch.equal(run.fw_chosen.sum(-1), torch.full_like(run.fw_chosen.sum(-1), run.k, dtype=torch.long))
    if run.case.rule == "legacy":
        padded = fastvideo_topk(run.case.sparsity, run.case.grid)
        print(f"  legacy k {run.k} vs today's padded-cube k {padded} (fastwan at sparsity {run.case.sparsity}: "
              f"{topk_count(run.case.sparsity, run.n)})")


def test_fastvideo_means_are_over_real_tokens(run):
    """The captured bf16 cube means of q, k, v equal the means over each cube's real tokens, rounded to bf16."""
    assert len(run.fv["means"]) == 3
    for got, x in zip(run.fv["means"], (run.q, run.kk, run.v)):
        want = cube_means(x, run.cube, run.n)
        close = got.float() == want.to(torch.bfloat16).float()
        ulp = (got.float() - want).abs() <= want.abs() * 2 ** -7 + 1e-5
        print(f"  means: {int((~close).sum())} of {close.numel()} differ from round-to-bf16 (fp32 sum order)")
        assert bool(ulp.all()) and float((~close).float().mean()) < 1e-2


def test_fastvideo_scores_and_topk_rule(run):
    """Captured scores = bf16 matmul of the captured bf16 means / sqrt(D) in bf16; captured mask = the k largest
    captured scores with ties to the lower index; the mask from this file's own bf16 means differs only at ties."""
    qc, kc, _ = run.fv["means"]
    scores = run.fv["scores"]
    assert scores.dtype == torch.bfloat16
    again = torch.matmul(qc, kc.transpose(-1, -2)) / qc.shape[-1] ** 0.5
    assert torch.equal(again, scores), f"max diff {float((again.float() - scores.float()).abs().max()):.3e}"
    assert torch.equal(top_cubes(scores, run.k), run.fv["mask"])
    mine = bf16_scores(*(cube_means(t, run.cube, run.n) for t in (run.q, run.kk)))
    rule = top_cubes(mine, run.k)
    diff = rule != run.fv["mask"]
    rows = diff.any(-1)
    err = (mine.float() - scores.float()).abs().amax(-1, keepdim=True)
    tied = near_ties(scores.float(), run.k, 2 * err)
    print(f"  bf16 rule from own means: {int(rows.sum())} of {rows.numel()} rows differ from FastVideo's mask")
    assert bool((~diff | tied).all()) and float(rows.float().mean()) <= 0.01


# ------------------------------------------------------------------------------------------ 2-3. selection
def test_fastwan_kernels_select_alike(run):
    """The layout's block size (the fa4 case may use 128 slots per cube) does not change fastwan's selection."""
    chosen = [sel for _, sel in run.fw.values()]
    assert all(torch.equal(c, chosen[0]) for c in chosen[1:])


def _selection_stats(run):
    fv, fw = run.fv["mask"], run.fw_chosen
    diff = fv != fw
    rows = diff.any(-1)
    return diff, rows


def test_selection_identical_to_fastvideo(run):
    """Strict: fastwan keeps exactly FastVideo's key cubes for every (batch, head, query cube)."""
    diff, rows = _selection_stats(run)
    n_rows = int(rows.sum())
    assert n_rows == 0, (
        f"{n_rows} of {rows.numel()} (batch, head, query cube) rows select other key cubes than FastVideo "
        f"({int(diff.sum()) // 2} swapped cubes, at most {int(diff.sum(-1).max()) // 2} per row); both should rank "
        f"bf16-rounded cube scores (ties to the lower index) -- see test_selection_differs_only_at_rounding_ties")


def test_selection_differs_only_at_rounding_ties(run):
    """Same k; every cube kept by one side only scores within FastVideo's own rounding error of the k-th best;
    fastwan's choice is the bf16-score rule up to such ties."""
    qc, kc = (cube_means(t, run.cube, run.n) for t in (run.q, run.kk))
    exact = exact_scores(qc, kc)
    diff, rows = _selection_stats(run)
    err = (run.fv["scores"].double() - exact).abs().amax(-1, keepdim=True)
    tied = near_ties(exact, run.k, 2 * err + 1e-5 * exact.abs().amax(-1, keepdim=True))
    print(f"  fastwan vs FastVideo: {int(rows.sum())} of {rows.numel()} rows differ, {int(diff.sum()) // 2} "
          f"cubes swapped; FastVideo's score error up to {float(err.max()):.2e} (scores up to "
          f"{float(exact.abs().max()):.2f})")
    assert bool((~diff | tied).all()), "fastwan and FastVideo differ at cubes that are no rounding tie"
    own = top_cubes(bf16_scores(qc, kc), run.k) != run.fw_chosen
    print(f"  fastwan vs the bf16-score rule: {int(own.any(-1).sum())} rows differ (rounding ties only)")
    assert bool((~own | tied).all())


# ------------------------------------------------------------------------------------------ 4. outputs
def within(out_rows, ref, mag, keep=None, atol=ATOL, rtol=RTOL):
    """(ok bool [B, r, H, D], max abs error) of ``|out - ref| <= atol + rtol * mag`` on the (token, head) rows of
    ``keep`` (bool [B, r, H]; all rows when None)."""
    err = (out_rows.float() - ref).abs()
    ok = err <= atol + rtol * mag
    if keep is not None:
        ok = ok | ~keep[..., None]
        err = err * keep[..., None]
    return ok, float(err.max()) if err.numel() else 0.0


def check(label, out_rows, ref, mag, keep=None, atol=ATOL):
    ok, err = within(out_rows, ref, mag, keep, atol)
    print(f"  {label}: max abs err {err:.2e}")
    assert bool(ok.all()), f"{label}: {int((~ok).sum())} elements beyond {atol} + {RTOL} (|fine| + |coarse*gate|)"


@pytest.mark.parametrize("kernel", list(FASTWAN_KERNELS))
def test_outputs_match_reference(run, kernel):
    if kernel not in run.fw:
        pytest.skip(f"fastwan kernel {kernel}: {run.skipped.get(kernel)}")
    cubes = sampled_query_cubes(run.case.grid, run.n, run.q.device)
    fv_mask, fw_mask = run.fv["mask"], run.fw[kernel][1]
    rows, ref_fv, mag_fv = run.reference("fastvideo-selection", fv_mask, cubes)
    _, ref_fw, mag_fw = run.reference(f"fastwan-selection-{kernel}", fw_mask, cubes)
    fv_out, fw_out = run.fv_out[:, rows], run.fw[kernel][0][:, rows]
    row_cube = run.cube[rows]

    def agree(a, b):  # bool [B, r, H]: the two selections of each token's query cube are the same
        return (a == b).all(-1)[:, :, row_cube].permute(0, 2, 1)

    # teeth: the selection changes the output by far more than the tolerance
    _, ref_dense, _ = run.reference("all-cubes", torch.ones_like(fv_mask), cubes)
    gap = float((ref_dense - ref_fv).abs().max())
    print(f"  [{kernel}] {rows.numel()} query tokens; the reference with every cube kept differs by {gap:.2e}")
    assert gap > 5 * ATOL

    check("FastVideo vs reference (FastVideo's selection)", fv_out, ref_fv, mag_fv)
    check(f"fastwan[{kernel}] vs reference (fastwan's selection)", fw_out, ref_fw, mag_fw)

    # the reference choosing by the rule itself: bf16 scores (FastVideo's rule, which fastwan follows)
    qc, kc = (cube_means(t, run.cube, run.n) for t in (run.q, run.kk))
    bf16_rule = top_cubes(bf16_scores(qc, kc), run.k)
    _, ref_bf16, mag_bf16 = run.reference("bf16-rule", bf16_rule, cubes)
    keep_fv, keep_fw = agree(fv_mask, bf16_rule), agree(fw_mask, bf16_rule)
    print(f"  bf16-score rule selections: FastVideo on {float(keep_fv.float().mean()):.2%}, fastwan on "
          f"{float(keep_fw.float().mean()):.2%} of the sampled (token, head) rows")
    assert float(keep_fv.float().mean()) >= 0.99 and float(keep_fw.float().mean()) >= 0.99
    check("FastVideo vs reference (bf16-score rule)", fv_out, ref_bf16, mag_bf16, keep_fv)
    check(f"fastwan[{kernel}] vs reference (bf16-score rule)", fw_out, ref_bf16, mag_bf16, keep_fw)

    # FastVideo vs fastwan directly: within twice the tolerance where both chose the same cubes
    both = agree(fv_mask, fw_mask)
    ok, err = within(fw_out, fv_out.float(), mag_fv, both, atol=2 * ATOL, rtol=2 * RTOL)
    _, other = within(fw_out, fv_out.float(), mag_fv, ~both)
    print(f"  FastVideo vs fastwan[{kernel}]: max abs diff {err:.2e} where the selections agree "
          f"({float(both.float().mean()):.1%} of the sampled (token, head) rows), {other:.2e} where they differ")
    assert bool(ok.all()), f"FastVideo and fastwan[{kernel}] differ beyond 2 x the tolerance where they agree"
