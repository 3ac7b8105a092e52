"""The fast build of the Wan DiT against the reference build (diffusers' rounding points), on the CPU in fp32,
where the fused ops run their PyTorch references: the wiring of the fast block (norm kernels that add what the
stream has pending, residual adds inside the output GEMMs, per-prompt cross-attention keys and values, collapsed
text padding, the folded output projection) must give the reference's predictions. Which route ran is read
from the profiler's op names. bf16 on the GPU against diffusers: tests/gpu/."""
from __future__ import annotations

import pytest
import torch

from fastwan.attention import AttentionDispatch
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.models import WanTransformer, load_transformer
from fastwan.models.wan.block import FastWanBlock, Residual, WanBlock
from fastwan.models.wan.cross import CrossKV, PromptCache
from fastwan.options import DiTOptions
from tests.models.test_text_keys import padded

FAST, REF = DiTOptions(block="fast"), DiTOptions(block="reference")


def build(ckpt, options, dtype=torch.float32, backend="TORCH_SDPA", conf=None):
    attn = AttentionDispatch.resolve(backend, device="cpu", dtype=dtype, head_dim=12, config=conf)
    return load_transformer(ckpt / "transformer", dtype=dtype, device="cpu", attention=attn, options=options)


def op_calls(fn):
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with prof:
        out = fn()
    names = [e.name for e in prof.events() if e.name.startswith("fastwan::")]
    return out, {n: names.count(n) for n in set(names)}


def text(model, B, lengths, L=9, seed=0, dtype=torch.float32):
    """[B, L, text_dim]: ``lengths[b]`` random rows then zero padding (as the pipelines pad a prompt)."""
    return padded(B, L, model.config.text_dim, lengths, seed=seed, dtype=dtype)


def test_builds_pick_their_block():
    assert DiTOptions().resolve("cpu", torch.bfloat16).block == "reference"  # the kernels do not run on the CPU
    assert DiTOptions().resolve("cpu", torch.float32).block == "reference"
    assert DiTOptions(block="fast").resolve("cpu", torch.float32).block == "fast"
    with pytest.raises(InvalidArgument, match="block='turbo' must be one of"):
        DiTOptions(block="turbo")
    with pytest.raises(InvalidArgumentType, match="block=1 must be a string"):
        DiTOptions(block=1)
    from fastwan.models import WanConfig

    cfg = WanConfig(num_layers=1, num_attention_heads=2, attention_head_dim=12, ffn_dim=16, text_dim=8,
                    freq_dim=8, in_channels=4, out_channels=4)
    with pytest.raises(InvalidArgument, match="not resolved"):
        WanTransformer(cfg, options=DiTOptions())
    assert isinstance(WanTransformer(cfg).blocks[0], WanBlock) and not isinstance(WanTransformer(cfg).blocks[0],
                                                                                  FastWanBlock)
    assert isinstance(WanTransformer(cfg, options=FAST).blocks[0], FastWanBlock)


@pytest.mark.parametrize("variant,dtype,backend,conf", [
    ("wan2.1", torch.float32, "TORCH_SDPA", None),
    ("wan2.1", torch.bfloat16, "TORCH_SDPA", None),
    ("wan2.2-ti2v", torch.float32, "TORCH_SDPA", None),
    # sparse: tile-major token order with padded slots (3 x 3 x 5 tokens, tiles 2 x 2 x 4), per-token modulation
    ("wan2.1", torch.float32, "SLIDING_TILE_ATTN", {"tile": [2, 2, 4], "window": 1}),
    ("wan2.2-ti2v", torch.float32, "VIDEO_SPARSE_ATTN", {"tile": [2, 2, 4], "sparsity": 0.5}),
])
def test_per_sample_modulation_leaves_outputs_pending(tiny_ckpts, variant, dtype, backend, conf):
    """Batch 2 with two timesteps (per-sample) or TI2V's per-token timesteps: each projection's output is left
    for the next norm kernel (residual_norm_mod), nothing is added inside a GEMM."""
    ref, fast = (build(tiny_ckpts[variant], o, dtype, backend, conf) for o in (REF, FAST))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, ref.config.in_channels, 3, 6, 10, generator=g)
    t = torch.stack([torch.full((45,), 901.0), torch.full((45,), 17.0)]) if variant == "wan2.2-ti2v" \
        else torch.tensor([700.0, 300.0])
    prompt = text(ref, 2, [4, 9], dtype=dtype)  # the second sample has no padding: no collapsed keys
    with torch.no_grad():
        want = ref(x, t, prompt)
        got, calls = op_calls(lambda: fast(x, t, prompt))
    n = ref.config.num_layers
    assert "fastwan::residual_linear_" not in calls
    assert calls["fastwan::residual_norm_mod"] == 3 * n - 1  # every norm but the first adds a pending output
    assert calls["fastwan::rms_rope"] == 4 * n  # q, k of both attentions (a sample without padding: no collapse)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("variant,dtype,backend,conf", [
    ("wan2.1", torch.float32, "TORCH_SDPA", None),
    ("wan2.1", torch.bfloat16, "TORCH_SDPA", None),
    ("wan2.2-a14b", torch.float32, "TORCH_SDPA", None),
    ("wan2.1", torch.float32, "SLIDING_TILE_ATTN", {"tile": [2, 2, 4], "window": 1}),
])
def test_one_modulation_vector_adds_inside_the_gemms(tiny_ckpts, variant, dtype, backend, conf):
    """Batch 1: the output projections add into x inside their GEMMs, their biases ride along as an fp32 offset;
    forward and forward_cfg in both modes give the reference's predictions (the sequential passes must not see
    each other's in-place updates)."""
    ref, fast = (build(tiny_ckpts[variant], o, dtype, backend, conf) for o in (REF, FAST))
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(1, ref.config.in_channels, 3, 6, 10, generator=g), torch.tensor([700.0])
    cond, uncond = text(ref, 1, [5], dtype=dtype), text(ref, 1, [2], seed=1, dtype=dtype)
    with torch.no_grad():
        want, want_u = ref(x, t, cond), ref(x, t, uncond)
        got, calls = op_calls(lambda: fast(x, t, cond))
        cfg = {b: fast.forward_cfg(x, t, cond, uncond, batched=b) for b in (True, False)}
    n = ref.config.num_layers
    assert calls["fastwan::residual_linear_"] == 3 * n and calls["fastwan::offset_norm_mod"] == 3 * n
    assert "fastwan::residual_norm_mod" not in calls
    assert calls["fastwan::text_cross_attention_normq"] == n  # padded prompt: the collapsed text attention
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for c, u in cfg.values():
        torch.testing.assert_close(c.float(), want.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(u.float(), want_u.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("batch", [1, 2])
def test_cross_attention_routes_follow_the_prompts(tiny_ckpts, batch):
    """No padding: the dispatch's backend over all keys; padding: the collapsed kernel; short prompts with a fold
    width allowed: P @ U (residual_bmm_ at one modulation vector, baddbmm otherwise). All equal the reference."""
    ref = build(tiny_ckpts["wan2.1"], REF)
    fast = build(tiny_ckpts["wan2.1"], FAST)
    fold = build(tiny_ckpts["wan2.1"], FAST)
    fold.prompts = PromptCache(fold_max_width=2.0)  # head dim 12: widths of 8 and 16 fold
    g = torch.Generator().manual_seed(5)
    x = torch.randn(batch, 16, 3, 6, 10, generator=g)
    t = torch.tensor([700.0, 300.0][:batch])
    cases = {"full": [9] * batch, "collapsed": [6, 3][:batch]}
    n = ref.config.num_layers
    with torch.no_grad():
        for name, lengths in cases.items():
            prompt = text(ref, batch, lengths)
            want = ref(x, t, prompt)
            got, calls = op_calls(lambda p=prompt: fast(x, t, p))
            assert ("fastwan::text_cross_attention_normq" in calls) == (name == "collapsed"), name
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        prompt = text(ref, batch, [6, 3][:batch])
        got, calls = op_calls(lambda: fold(x, t, prompt))
        assert calls["fastwan::text_cross_probs_normq"] == n
        assert calls.get("fastwan::residual_bmm_", 0) == (n if batch == 1 else 0)
        torch.testing.assert_close(got, ref(x, t, prompt), rtol=1e-5, atol=1e-5)


def test_prompt_cache_follows_texts_and_weights(tiny_ckpts):
    fast = build(tiny_ckpts["wan2.1"], FAST)
    a, b = text(fast, 1, [4]), text(fast, 1, [6], seed=2)
    with torch.no_grad():
        first = fast._contexts((a,))
        assert fast._contexts((a,)) is first  # the same prompt tensor: computed once
        assert isinstance(first[0], CrossKV) and first[0].keys.tolist() == [5]
        other = fast._contexts((b,))
        assert other is not first and other[0].keys.tolist() == [7]
        a[0, 0, 0] += 1.0  # the text changed in place: recomputed
        assert fast._contexts((a,)) is not first
        again = fast._contexts((a,))
        fast.blocks[0].attn2.to_k.weight.add_(0.1)  # the weights changed in place (e.g. a merged LoRA)
        fresh = fast._contexts((a,))
        assert fresh is not again and not torch.equal(fresh[0].k, again[0].k)


def test_prompt_cache_lets_go_with_its_texts(tiny_ckpts):
    """An entry is dropped as soon as one of its text tensors is freed (nothing is held through the VAE decode or
    between requests), and only that entry: a later tensor that reuses a freed tensor's id starts a new one."""
    import gc
    import weakref

    fast = build(tiny_ckpts["wan2.1"], FAST)
    a, b, c = (text(fast, 1, [n], seed=n) for n in (3, 4, 5))
    with torch.no_grad():
        kv_a = weakref.ref(fast._contexts((a,))[0].k)
        fast._contexts((b, c))
        assert len(fast.prompts) == 2
        del a
        assert len(fast.prompts) == 1 and kv_a() is None  # freed at once, no gc pass needed
        del c
        assert len(fast.prompts) == 0
        for _ in range(3):  # fresh tensors (ids may repeat): each one's entry lives exactly as long as it does
            d = text(fast, 1, [4], seed=7)
            kvs = fast._contexts((d, b))
            assert fast._contexts((d, b)) is kvs and len(fast.prompts) == 1
            del d, kvs
            gc.collect()
            assert len(fast.prompts) == 0


def test_fast_block_compiles_in_place_and_once_per_prompt_width(tiny_ckpts):
    """Inductor (CPU) compiles the fast blocks with fullgraph=True, keeps the GEMM's update of x in place, and does
    not recompile for a prompt of another fold width (the width dim is dynamic)."""
    torch._dynamo.reset()
    ref = build(tiny_ckpts["wan2.1"], REF)
    fast = build(tiny_ckpts["wan2.1"], FAST)
    fast.prompts = PromptCache(fold_max_width=2.0)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(1, 16, 3, 8, 8, generator=g), torch.tensor([700.0])
    short, longer, uncond = text(ref, 1, [3]), text(ref, 1, [6]), text(ref, 1, [4], seed=3)
    with torch.no_grad():
        fast.compile_blocks(fullgraph=True)
        blk = fast.blocks[1]
        xin = torch.randn(1, 48, blk.norm1.normalized_shape[0])
        ctx = fast._contexts((short,))[1]
        out = blk(Residual(xin, offset=torch.zeros(1, 1, xin.shape[-1])), ctx, torch.randn(1, 6, xin.shape[-1]),
                  fast._rope((3, 4, 4), xin.device), fast.attention)
        assert out.x.data_ptr() == xin.data_ptr() and out.offset is not None  # updated in place
        from torch._dynamo.utils import counters

        counters.clear()
        for prompt in (short, longer):  # widths 8 and 16
            torch.testing.assert_close(fast(x, t, prompt), ref(x, t, prompt), rtol=1e-5, atol=1e-5)
        frames = counters["stats"]["unique_graphs"]
        for b in (True, False):
            c, u = fast.forward_cfg(x, t, short, uncond, batched=b)
            torch.testing.assert_close(c, ref(x, t, short), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(u, ref(x, t, uncond), rtol=1e-5, atol=1e-5)
    assert frames <= 2  # one graph for the blocks (both widths), at most one more for the second width's guard
    torch._dynamo.reset()
