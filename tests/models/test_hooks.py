"""Hooks (fastwan.hooks) and the Wan DiT's one-path forward: a hook wraps its call points in order and comes off
leaving the module as it was; the DiT's forward names no step cache, streaming or sequence parallelism (they are
hooks: fastwan.models.wan.step_cache, fastwan.offload.stream, fastwan.parallel.plan), and each hook comes off
bit-exactly, also around blocks compiled with fullgraph=True."""
from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fastwan.attention import AttentionDispatch
from fastwan.cache import CacheRun, FirstBlockCache, SkipSteps
from fastwan.errors import InvalidArgument
from fastwan.hooks import Hook, HookRegistry
from fastwan.models import WanTransformer, load_transformer
from fastwan.models.wan.step_cache import apply_step_cache, remove_step_cache
from fastwan.offload.stream import BlockStreamer, stop_streaming, stream_blocks
from fastwan.options import DiTOptions


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = [lambda v: v + 1, lambda v: v * 2]

    def step(self, v):
        return v - 1


class Tag(Hook):
    """Records its tag around every point it is given."""

    def __init__(self, name, points, log, refuse=False):
        self.name, self._points, self.log, self.refuse = name, points, log, refuse

    def points(self, module):
        return {p: self._wrap for p in self._points}

    def _wrap(self, module, inner, v):
        self.log.append(self.name)
        return inner(v) * 10

    def attach(self, module):
        if self.refuse:
            raise InvalidArgument("refused")
        self.log.append(f"+{self.name}")

    def detach(self, module):
        self.log.append(f"-{self.name}")


def test_hooks_nest_in_order_and_come_off_leaving_the_module_as_it_was():
    m, log = Toy(), []
    own = list(m.calls)
    reg = HookRegistry.of(m)
    assert HookRegistry.of(m) is reg
    reg.add(Tag("a", ["step", "calls.1"], log))
    reg.add(Tag("b", ["step"], log))
    assert m.step(3) == 200 and log == ["+a", "+b", "b", "a"]  # the last added runs outermost
    assert m.calls[1](3) == 60 and m.calls[0] is own[0]
    with pytest.raises(InvalidArgument, match="already on this Toy"):
        reg.add(Tag("a", ["step"], log))
    with pytest.raises(InvalidArgument, match="no call point 'calls.5'"):
        reg.add(Tag("c", ["calls.5"], log))
    with pytest.raises(InvalidArgument, match="refused"):
        reg.add(Tag("d", ["step"], log, refuse=True))
    assert reg.names() == ["a", "b"]  # a refused or bad hook changed nothing
    reg.remove("a")
    assert log[-1] == "-a" and m.step(3) == 20 and m.calls[1] is own[1]
    reg.remove("b")
    assert reg.remove("b") is None and reg.names() == []
    assert "step" not in m.__dict__ and m.step(3) == 2 and m.calls == own  # the class's method, the list's own


def model(ckpt: Path, block: str) -> WanTransformer:
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    return load_transformer(ckpt / "transformer", dtype=torch.float32, device="cpu", attention=attn,
                            options=DiTOptions(block=block))


def inputs(m: WanTransformer, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    text = torch.randn(1, 9, m.config.text_dim, generator=g)
    return torch.randn(1, 16, 3, 8, 8, generator=g), torch.tensor([700.0]), text, torch.zeros_like(text)


def unhooked(m: WanTransformer) -> bool:
    points = {"embed", "head", "run_blocks", "run_cfg", "set_attention"}
    return (HookRegistry.of(m).names() == [] and not points & set(m.__dict__)
            and all(c is b for c, b in zip(m.block_calls, m.blocks, strict=True)))


STRAIGHT = ["forward", "forward_cfg", "embed", "run_blocks", "blocks_range", "run_cfg", "head"]


def test_the_dit_forward_is_one_path():
    """The forward's methods name no step cache, streamer or sequence parallelism, and forward has no branch."""
    banned = re.compile(r"cache|stream|_sp\b|^sp$|parallel|shard|gather|ulysses", re.I)
    for name in STRAIGHT:
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(WanTransformer, name))))
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
        assert not {n for n in names if banned.search(n)}, name
    forward = ast.parse(textwrap.dedent(inspect.getsource(WanTransformer.forward)))
    assert not [n for n in ast.walk(forward) if isinstance(n, (ast.If, ast.IfExp, ast.For, ast.Try))]
    module = ast.parse(Path(inspect.getsourcefile(WanTransformer)).read_text())
    imported = {n.module for n in ast.walk(module) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if re.match(r"fastwan\.(cache|parallel|offload)", m)}


@pytest.mark.parametrize("block", ["reference", "fast"])
def test_the_step_cache_comes_off_bit_exactly(tiny_ckpts, block):
    m = model(tiny_ckpts["wan2.1"], block)
    x, t, text, uncond = inputs(m)
    with torch.no_grad():
        plain = m(x, t, text, step_index=0, num_steps=3)
        plain_cfg = m.forward_cfg(x, t, text, uncond, batched=False, step_index=0, num_steps=3)
        runs = [CacheRun(SkipSteps((1, 2)), 3) for _ in range(2)]
        hook = apply_step_cache(m, runs[0])
        for step in range(3):
            hook.select("uncond")
            m(x, t, uncond, step_index=step, num_steps=3)
        with pytest.raises(InvalidArgument, match="needs step_index"):
            m(x, t, text)
        remove_step_cache(m)
        apply_step_cache(m, runs[1])
        for step in range(3):
            m.forward_cfg(x, t, text, uncond, batched=False, step_index=step, num_steps=3)
        with pytest.raises(InvalidArgument, match="pass batched=False"):
            m.forward_cfg(x, t, text, uncond, step_index=0, num_steps=3)
        remove_step_cache(m)
        assert [r.report()["computed"] for r in runs] == [{"uncond": [0]}, {"cond": [0], "uncond": [0]}]
        assert unhooked(m)
        assert torch.equal(m(x, t, text, step_index=0, num_steps=3), plain)
        for a, b in zip(m.forward_cfg(x, t, text, uncond, batched=False, step_index=0, num_steps=3), plain_cfg):
            assert torch.equal(a, b)


def test_streaming_runs_around_the_streamed_blocks_and_comes_off_bit_exactly(tiny_ckpts):
    m = model(tiny_ckpts["wan2.1"], "reference")
    x, t, text, uncond = inputs(m)
    with torch.no_grad():
        plain = m(x, t, text)
        plain_cfg = m.forward_cfg(x, t, text, uncond)
        streamer = BlockStreamer(m.blocks, "cpu", [1])
        calls = []
        before, after = streamer.before, streamer.after
        streamer.before = lambda i: calls.append(("before", i)) or before(i)
        streamer.after = lambda i: calls.append(("after", i)) or after(i)
        stream_blocks(m, streamer)
        assert torch.equal(m(x, t, text), plain)
        assert all(torch.equal(a, b) for a, b in zip(m.forward_cfg(x, t, text, uncond), plain_cfg))
        assert calls == [("before", 1), ("after", 1)] * 2
        with pytest.raises(InvalidArgument, match="not this WanTransformer's blocks"):
            HookRegistry.of(model(tiny_ckpts["wan2.1"], "reference")).add(type(HookRegistry.of(m).get(
                "block_streaming"))(streamer))
        stop_streaming(m)
        streamer.close()
        assert unhooked(m) and torch.equal(m(x, t, text), plain)
        assert len(calls) == 4


def test_hooks_around_blocks_compiled_with_fullgraph(tiny_ckpts):
    """Hooks run between compiled blocks: fullgraph=True (any graph break raises) holds with the step cache and
    streaming on, and the predictions are the eager ones under the same hooks."""
    torch._dynamo.reset()
    eager, comp = (model(tiny_ckpts["wan2.1"], "reference") for _ in range(2))
    comp.compile_blocks(fullgraph=True, backend="aot_eager")
    x, t, text, uncond = inputs(eager)
    got, want = [], []
    with torch.no_grad():
        for m, out in ((eager, want), (comp, got)):
            streamer = BlockStreamer(m.blocks, "cpu", [1])
            stream_blocks(m, streamer)
            hook = apply_step_cache(m, CacheRun(FirstBlockCache(0.05), 3))
            for step in range(3):
                hook.select("cond")
                out.append(m(x, t, text, step_index=step, num_steps=3))
                out.extend(m.forward_cfg(x, t, text, uncond, batched=False, step_index=step, num_steps=3))
            remove_step_cache(m)
            stop_streaming(m)
            streamer.close()
            out.extend(m.forward_cfg(x, t, text, uncond))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
