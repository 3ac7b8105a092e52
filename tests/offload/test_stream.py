"""BlockStreamer on the CPU: streamed blocks compute bit-identically to resident ones, their tensors are host copies
outside before/after and fresh copies inside, kept tensors and other blocks never move, and the sizes and errors."""
import copy

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from fastwan.errors import InvalidArgument
from fastwan.offload import BlockStreamer

D = 8
N = 4
STREAMED = [0, 2, 3]  # block 1 stays resident


def keep_kv(name: str) -> bool:
    return name.startswith(("attn2.to_k.", "attn2.to_v."))


class Cross(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_k = nn.Linear(D, D)
        self.to_v = nn.Linear(D, D)


class Toy(nn.Module):
    """x [B, D] -> [B, D]; ``pad`` (unused, 16 * (i + 1) floats) makes the blocks' sizes differ."""

    def __init__(self, i: int):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.attn2 = Cross()
        self.register_buffer("scale", torch.rand(D) + 0.5)
        self.register_buffer("pad", torch.zeros(16 * (i + 1)))

    def forward(self, x):
        return self.norm(self.lin(x) * self.scale) + self.attn2.to_k(x) - 0.5 * self.attn2.to_v(x) + x


def make(seed: int = 0):
    """(blocks, an unstreamed reference copy, an input x [3, D])."""
    torch.manual_seed(seed)
    blocks = nn.ModuleList([Toy(i) for i in range(N)])
    return blocks, copy.deepcopy(blocks), torch.randn(3, D)


def tensors(block: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(block.named_parameters()), **dict(block.named_buffers())}


def ptrs(block: nn.Module) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in tensors(block).items()}


def run(blocks, x, order, streamer=None, check=None):
    """x through ``blocks`` in ``order`` (the sequence restarting at 0 feeds the first pass's output back)."""
    for i in order:
        if streamer is not None:
            streamer.before(i)
        if check is not None:
            check(i)
        x = blocks[i](x)
        if streamer is not None:
            streamer.after(i)
    return x


PLAIN = list(range(N))
CFG = [0, *range(1, N), 0, *range(1, N)]


@pytest.mark.parametrize("order", [PLAIN, CFG], ids=["plain", "cfg"])
def test_streamed_outputs_and_tensor_placement(order):
    blocks, ref, x = make()
    before = [ptrs(b) for b in blocks]
    s = BlockStreamer(blocks, "cpu", STREAMED, keep=keep_kv)
    host = [ptrs(b) for b in blocks]

    def check(i):
        assert len(s._live) + (s._pending is not None) <= 2  # the running block and the prefetched next
        for n, t in tensors(blocks[i]).items():
            assert torch.equal(t, tensors(ref[i])[n])
            moves = i in STREAMED and not keep_kv(n)
            assert (t.data_ptr() != host[i][n]) == moves, n  # a fresh copy inside the call
        for j in range(N):
            if j != i:
                assert ptrs(blocks[j]) == host[j]  # every other block holds its host copies

    with torch.no_grad():
        got = run(blocks, x, order, s, check)
        want = run(ref, x, order)
    assert torch.equal(got, want)
    for i in range(N):
        assert ptrs(blocks[i]) == host[i]
        for n, p in before[i].items():
            if i not in STREAMED or keep_kv(n):
                assert host[i][n] == p, (i, n)  # kept tensors and resident blocks never move


def test_prefetch_wraps_around():
    blocks, _, x = make()
    s = BlockStreamer(blocks, "cpu", STREAMED)
    seen = []
    with torch.no_grad():
        run(blocks, x, CFG, s, lambda i: seen.append(None if s._pending is None else s._pending.index))
    # block 1 is not streamed: its before() starts nothing, and block 0's prefetch of block 2 is still pending
    assert seen == [2, 2, 3, 0] * 2


def test_before_uses_the_prefetched_copy():
    blocks, _, x = make()
    s = BlockStreamer(blocks, "cpu", STREAMED)  # nothing kept: every tensor of a streamed block is copied
    prefetched = {}

    def check(i):
        if i in prefetched:  # the block runs on the very tensors its prefetch made
            assert set(ptrs(blocks[i]).values()) == prefetched.pop(i)
        if s._pending is not None:
            prefetched[s._pending.index] = {t.data_ptr() for t in s._pending.tensors}

    with torch.no_grad():
        run(blocks, x, CFG, s, check)
    assert set(prefetched) == {0}  # only the wrap-around prefetch of the last call is left


def test_hook_mode_restores_host_copies_when_forward_raises():
    blocks, _, _ = make()
    s = BlockStreamer(blocks, "cpu", STREAMED)
    host = ptrs(blocks[0])
    s.attach_hooks()
    with pytest.raises(RuntimeError):
        blocks[0](torch.randn(3, D + 1))
    assert ptrs(blocks[0]) == host
    with torch.no_grad():
        blocks[0](torch.randn(3, D))  # and the next call can bring the block in again


def test_one_streamed_block_and_resident_context():
    blocks, ref, x = make()
    s = BlockStreamer(blocks, "cpu", [2])
    host = ptrs(blocks[2])
    with s.resident(2):
        assert all(ptrs(blocks[2])[n] != p for n, p in host.items())
        assert s._pending is None  # the next streamed block is this one, already on the device
    assert ptrs(blocks[2]) == host
    with torch.no_grad():
        assert torch.equal(run(blocks, x, CFG, s), run(ref, x, CFG))


def test_hook_mode():
    blocks, ref, x = make()
    s = BlockStreamer(blocks, "cpu", STREAMED, keep=keep_kv)
    host = [ptrs(b) for b in blocks]
    handles = s.attach_hooks()
    assert len(handles) == 2 * len(STREAMED)
    inside = []

    def probe(i):  # registered after the streamer's pre-hook, so it sees the device copies
        return lambda m, a: inside.append(ptrs(m)["lin.weight"] != host[i]["lin.weight"])

    probes = [blocks[i].register_forward_pre_hook(probe(i)) for i in STREAMED]
    with torch.no_grad():
        got = run(blocks, x, CFG)
        assert torch.equal(got, run(ref, x, CFG))
    assert inside == [True] * 2 * len(STREAMED)
    assert [ptrs(b) for b in blocks] == host
    s.detach_hooks()
    assert all(len(b._forward_hooks) == 0 for b in blocks)
    inside.clear()
    with torch.no_grad():
        run(blocks, x, PLAIN)
    assert inside == [False] * len(STREAMED)  # no streamer hooks: the blocks run on their host copies
    for h in probes:
        h.remove()


def test_sizes():
    blocks, _, _ = make()
    nbytes = [sum(t.numel() * t.element_size() for n, t in tensors(b).items() if not keep_kv(n)) for b in blocks]
    s = BlockStreamer(blocks, "cpu", STREAMED, keep=keep_kv)
    assert s.host_bytes() == sum(nbytes[i] for i in STREAMED)
    assert s.device_bytes() == nbytes[3] + nbytes[2]  # the two largest streamed blocks (pad grows with i)
    assert s.block_bytes(1) == 0


def test_close_restores_plain_modules():
    blocks, ref, x = make()
    s = BlockStreamer(blocks, "cpu", STREAMED, keep=keep_kv)
    host = [ptrs(b) for b in blocks]
    s.attach_hooks()
    s.close()
    assert all(len(b._forward_pre_hooks) == 0 for b in blocks)
    for i in STREAMED:
        assert all(ptrs(blocks[i])[n] != p for n, p in host[i].items() if not keep_kv(n))
    after_close = [ptrs(b) for b in blocks]
    with torch.no_grad():
        s.before(0)  # a no-op once closed
        assert ptrs(blocks[0]) == after_close[0]
        s.after(0)
        assert torch.equal(run(blocks, x, CFG), run(ref, x, CFG))
    assert [ptrs(b) for b in blocks] == after_close
    assert s.host_bytes() == 0


@pytest.mark.parametrize("streamed, match", [([0, 4], r"\b4\b.*out of range"), ([-1], "-1"),
                                             ([1, 2, 1], r"\[1\].*more than once"), ([1.0], "1.0.*float"),
                                             (["0"], "'0'.*str"), ([True], "True.*bool")])
def test_bad_indices(streamed, match):
    blocks, _, _ = make()
    with pytest.raises(InvalidArgument, match=match):
        BlockStreamer(blocks, "cpu", streamed)


def test_bad_call_index_and_pairing():
    blocks, _, _ = make()
    s = BlockStreamer(blocks, "cpu", STREAMED)
    with pytest.raises(InvalidArgument, match=r"\b7\b.*out of range"):
        s.before(7)
    s.before(0)
    with pytest.raises(RuntimeError, match="already on the device"):
        s.before(0)
    s.after(0)
    with pytest.raises(RuntimeError, match="without before"):
        s.after(0)


def test_compiled_block_reads_the_streamed_tensors():
    torch._dynamo.reset()
    torch.manual_seed(1)
    blk, x = Toy(1), torch.randn(3, D)
    ref = copy.deepcopy(blk)
    blk.compile(fullgraph=True, backend="aot_eager")
    s = BlockStreamer([blk], "cpu", [0])
    graphs = counters["stats"]["unique_graphs"]
    held, outs = [], []
    with torch.no_grad():
        for step in range(4):
            if step == 2:  # new host values must reach the compiled graph (no weights baked in as constants)
                blk.lin.weight.mul_(2.0)
                ref.lin.weight.mul_(2.0)
            with s.resident(0):
                held.append(blk.lin.weight.data)  # kept alive, so the next call's copy gets another address
                outs.append((blk(x), ref(x)))
    assert len({t.data_ptr() for t in held}) == len(held)
    for got, want in outs:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.allclose(outs[1][0], outs[2][0])
    assert counters["stats"]["unique_graphs"] == graphs + 1  # swapped tensors cause no recompiles


@torch.no_grad()
def test_host_changes_after_release_reach_the_next_pass():
    """Weights changed in place between passes (a LoRA merged between videos) are what the next pass computes with,
    once release() dropped the copy prefetched at the end of the last pass; without it that copy is stale."""
    blocks, ref, x = make()
    s = BlockStreamer(blocks, "cpu", STREAMED, keep=keep_kv)
    run(blocks, x, PLAIN, s)
    assert s._pending is not None and s._pending.index == STREAMED[0]  # the wrap-around prefetch of block 0
    for b, r in ((blocks[0], ref[0]), (blocks[2], ref[2])):
        for m in (b.lin, r.lin):
            m.weight.add_(0.25)
    stale = run(blocks, x, PLAIN, s)
    assert not torch.equal(stale, run(ref, x, PLAIN))  # block 0 ran with the copy taken before the change
    s.release()
    assert torch.equal(run(blocks, x, PLAIN, s), run(ref, x, PLAIN))
