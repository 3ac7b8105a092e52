"""The merge a ring runs (fastwan.parallel.ring.ring_merge) on the CPU: the compiled merge (inductor on the CPU)
equals the plain one on random partials with rows that have no keys, updating the fp32 output in place, and it
compiles when called from the ring's torch.compiler.disable'd frame; a dispatch whose ring is on CUDA devices (an
NCCL group) holds the compiled merge, one on the CPU (gloo) the plain one; ring_attention merges every step after
the first with the merge it is given (gloo processes), and its result is the whole sequence's attention."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fastwan.attention import AttentionDispatch
from fastwan.attention.registry import create_backend
from fastwan.parallel import SequenceParallel, UlyssesDispatch
from fastwan.parallel.ring import Ring, merge, ring_attention, ring_merge
from fastwan.parallel.ulysses import shard_sizes
from tests.parallel.test_sequence_parallel import run


@torch.compiler.disable
def _called_as_the_ring_calls(fn, *args):
    """``fn(*args)`` from a frame dynamo skips, as :func:`fastwan.parallel.ring.ring_attention` runs."""
    return fn(*args)


def _partials(dtype, seed):
    """(out fp32, lse, part_out of ``dtype``, part_lse) [B, S, H, D] / [B, S, H] with -inf rows (no keys): in
    ``lse`` only, in ``part_lse`` only, and in both."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(2, 6, 3, 8, generator=g)
    part_out = torch.randn(2, 6, 3, 8, generator=g).to(dtype)
    lse, part_lse = (torch.randn(2, 6, 3, generator=g) * 4 for _ in range(2))
    lse[:, 0] = -torch.inf
    part_lse[:, 1] = -torch.inf
    lse[:, 2, 1] = part_lse[:, 2, 1] = -torch.inf
    out[:, 0] = 0.0  # a partial over no keys is 0
    part_out[:, 1] = 0.0
    out[:, 2, 1] = part_out[:, 2, 1] = 0.0
    return out, lse, part_out, part_lse


def _graphs_made(fn, *args):
    """How many graphs dynamo compiles while ``fn(*args)`` runs from a skipped frame (its caches emptied first)."""
    torch._dynamo.reset()
    counters.clear()
    _called_as_the_ring_calls(fn, *args)
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_merge_equals_the_plain_merge_in_place(dtype):
    compiled = ring_merge("cuda")
    for seed in range(2):
        want_out, *rest = _partials(dtype, seed)
        want = merge(want_out, *rest)
        out, *rest = _partials(dtype, seed)
        got = _called_as_the_ring_calls(compiled, out, *rest)
        assert got[0].dtype == torch.float32
        torch.testing.assert_close(out, want[0], rtol=1e-6, atol=1e-6)  # the fp32 output updated in place
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
        assert torch.isneginf(got[1][:, 2, 1]).all() and not got[0][:, 2, 1].any()  # no keys on either side
        assert not got[0].isnan().any()


def test_cuda_rings_get_the_compiled_merge_and_cpu_rings_the_plain_one(monkeypatch):
    args = _partials(torch.float32, 0)
    assert ring_merge(torch.device("cpu")) is merge
    assert _graphs_made(ring_merge(torch.device("cuda", 0)), *args) == 1
    # the dispatch picks by its ring's process group: NCCL moves CUDA tensors, gloo CPU tensors
    ring = SequenceParallel(None, 2, 0, ring=Ring(object(), (0, 1), 0))
    sdpa = AttentionDispatch(create_backend("TORCH_SDPA"))
    for backend, compiled in (("gloo", False), ("nccl", True)):
        monkeypatch.setattr(dist, "get_backend", lambda group, name=backend: name)
        chosen = UlyssesDispatch(sdpa, ring).ring_merge
        assert (chosen is not merge) == compiled
        assert _graphs_made(chosen, *_partials(torch.float32, 0)) == int(compiled)


def _ring_with_given_merge(rank: int, case: dict) -> None:
    world = dist.get_world_size()
    ring = Ring(dist.group.WORLD, tuple(range(world)), rank)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 11, 2, 8, generator=g) for _ in range(3))
    chunks = shard_sizes(11, world)
    mine = slice(sum(chunks[:rank]), sum(chunks[:rank + 1]))
    calls = []
    got = ring_attention(q[:, mine], k[:, mine], v[:, mine], ring, chunks,
                         merge_fn=lambda *parts: calls.append(1) or merge(*parts))
    assert len(calls) == world - 1, f"rank {rank}: the given merge ran {len(calls)} times, not {world - 1}"
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)[:, mine]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_ring_attention_merges_with_the_merge_it_is_given(tmp_path):
    run(3, str(tmp_path / "store"), call=_ring_with_given_merge)
