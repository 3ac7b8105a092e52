"""Ring attention and Ulysses x Ring (USP) on the CPU: gloo processes, fp32. One spawn of 6 processes runs every
layout of 2, 3, 4 and 6 sequence ranks (the ranks 0..n-1 of the job): the gathered self-attention equals
``torch``'s dense attention of the whole sequence (``scaled_dot_product_attention``, an independent reference) at
token counts the process count does not divide (one with fewer tokens than processes), head counts it does not
divide, batch 2; a DiT split over 3 and 4 processes with 2 heads equals the one-process DiT. Without processes: the
automatic split's rule, pinned layouts refused with the ones that run, sparse backends refused under a ring."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastwan.attention import AttentionDispatch
from fastwan.attention.registry import create_backend
from fastwan.errors import InvalidArgument
from fastwan.parallel import SequenceParallel, UlyssesDispatch, shard_sizes
from fastwan.parallel.mesh import layouts, sequence_layout
from fastwan.parallel.plan import apply_sequence_parallel
from fastwan.parallel.ring import Ring, merge
from fastwan.parallel.ring_kernels import attention_lse
from tests.parallel.test_sequence_parallel import inputs, model, run

# (processes, heads, tokens, ring degree): every (Ulysses, Ring) split the heads allow, tokens not divided
ATTENTION = [(n, h, s, r) for n, h, s in ((2, 1, 47), (3, 2, 47), (4, 2, 47), (4, 6, 47), (6, 6, 47), (6, 2, 5))
             for _, r in layouts(h, n)]


def dense(q, k, v):
    """The whole sequence's attention, [B, S, H, D], by torch's own SDPA."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _attention_cases(rank: int, case: dict) -> None:
    sdpa = AttentionDispatch(create_backend("TORCH_SDPA"))
    for n, heads, tokens, ring in ATTENTION:
        sp = SequenceParallel.create(list(range(n)), ring)  # every rank makes every group, as new_group needs
        if sp is None:
            continue
        assert (sp.ulysses_degree, sp.ring_degree) == (n // ring, ring)
        g = torch.Generator().manual_seed(n * 100 + heads * 10 + ring)
        q, k, v = (torch.randn(2, tokens, heads, 8, generator=g) for _ in range(3))
        dispatch = UlyssesDispatch(sdpa, sp)
        dispatch.sizes = sizes = shard_sizes(tokens, n)
        got = sp.gather(dispatch.self_attention(*(sp.shard(t, sizes) for t in (q, k, v))), sizes)
        torch.testing.assert_close(got, dense(q, k, v), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, where=(n, heads, ring): f"(processes, heads, ring) {where}: {m}")


def _dit_cases(rank: int, case: dict) -> None:
    latents, timestep, text, text_uncond = inputs(per_token=True)
    ref = model("reference", "TORCH_SDPA", None, heads=2)
    with torch.no_grad():
        want = ref(latents, timestep, text, step_index=0, num_steps=1)
        want_cfg = ref.forward_cfg(latents, timestep, text, text_uncond, batched=True)
    for n, ring in ((3, 3), (4, 2), (4, 4)):  # 2 heads: 3 processes by the ring alone, 4 as 2 x 2 or a ring of 4
        sp = SequenceParallel.create(list(range(n)), ring) if n < 4 else SequenceParallel.from_group(ring_degree=ring)
        if sp is None:
            continue
        par = model("reference", "TORCH_SDPA", None, heads=2)
        apply_sequence_parallel(par, sp)
        with torch.no_grad():
            torch.testing.assert_close(par(latents, timestep, text, step_index=0, num_steps=1), want,
                                       rtol=1e-5, atol=1e-5)
            for a, b in zip(par.forward_cfg(latents, timestep, text, text_uncond, batched=True), want_cfg):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_ring_and_usp_attention_equal_dense_attention(tmp_path):
    run(6, str(tmp_path / "store"), call=_attention_cases)


def test_ring_and_usp_dit_equals_one_process(tmp_path):
    run(4, str(tmp_path / "store"), call=_dit_cases)


def test_partial_attentions_merge_to_the_whole():
    """The log-sum-exp merge of key halves (one of them empty) equals attention over all keys."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 3, 4, generator=g) for _ in range(3))
    scale = 0.5
    out, lse = attention_lse(q, k, v, scale)
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=scale).transpose(1, 2)
    torch.testing.assert_close(out, want)
    scores = torch.einsum("bqhd,bkhd->bqhk", q, k) * scale
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    parts = None
    for keys in (slice(0, 2), slice(2, 2), slice(2, 5)):
        parts = merge(*(parts or (None, None)), *attention_lse(q, k[:, keys], v[:, keys], scale))
    torch.testing.assert_close(parts[0], want)


@pytest.mark.parametrize("heads,sp,want", [(2, 3, (1, 3)), (2, 4, (2, 2)), (40, 8, (8, 1)), (12, 8, (4, 2)),
                                           (40, 6, (2, 3)), (5, 1, (1, 1))])
def test_automatic_split_is_ulysses_as_far_as_the_heads_divide(heads, sp, want):
    assert sequence_layout(heads, sp) == want
    u = want[0]  # the largest Ulysses degree among the layouts that run
    assert u == max(a for a, _ in layouts(heads, sp)) and heads % u == 0 and sp % u == 0


def test_pinned_layouts_that_cannot_run_are_refused_naming_those_that_can():
    assert sequence_layout(2, 4, 4) == (1, 4) and sequence_layout(40, 8, 1) == (8, 1)
    with pytest.raises(InvalidArgument, match=r"ring_degree=3 cannot split 4 .* use one of ring_degree=2 "
                                              r"\(Ulysses 2 x Ring 2\), ring_degree=4 \(Ulysses 1 x Ring 4\)"):
        sequence_layout(2, 4, 3)
    with pytest.raises(InvalidArgument, match="ring_degree=1 cannot split 4"):  # Ulysses 4 on 2 heads
        sequence_layout(2, 4, 1)
    for bad in (0, 2.5, True, "2"):
        with pytest.raises(InvalidArgument, match="must be a whole number >= 1"):
            sequence_layout(2, 4, bad)


def test_sparse_backends_are_refused_under_a_ring():
    sliding = AttentionDispatch.resolve("SLIDING_TILE_ATTN", device="cpu", dtype=torch.float32, head_dim=8,
                                        config={"tile": [1, 2, 2]})
    ring = SequenceParallel(None, 2, 0, ring=Ring(None, (0, 1), 0))
    with pytest.raises(InvalidArgument, match="SLIDING_TILE_ATTN cannot run under ring attention"):
        UlyssesDispatch(sliding, ring)
    UlyssesDispatch(sliding, SequenceParallel(None, 2, 0))  # Ulysses alone: every rank sees the whole sequence

