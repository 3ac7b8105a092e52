"""GPU: the image-conditioned DiT (Wan2.1 I2V and FLF2V: 36 input channels, CLIP image tokens through the
image embedder and each block's add_k_proj / add_v_proj) in bf16, compiled fast build and reference build, against
an fp32 model on the same weights; and the same against diffusers' WanTransformer3DModel in bf16.

Random weights at the Wan2.1-1.3B width (12 heads x 128) with 10 layers, on a small video grid. Tolerance as for
text-to-video (tests/gpu/test_gpu_fastpath.py): the reference build within 3e-2 relative L2 of fp32, the fast build
no further than 1.25x the reference's error.
"""
import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONFIG = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=10, text_dim=4096,
              in_channels=36, out_channels=16, image_dim=1280, added_kv_proj_dim=1536, patch_size=(1, 2, 2),
              freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def _rel(out, want):
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def _setup(flf2v: bool):
    """diffusers' model with random weights (bf16; fp32 where diffusers keeps it), a builder of fastwan models on
    the very same tensors (``build(DiTOptions)``), and the inputs (latents, timestep, 20-token text, CLIP tokens:
    one image, or first and last for FLF2V)."""
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("flash_attn.cute")
    from fastwan.attention import AttentionDispatch
    from fastwan.models import WanConfig, WanTransformer, keep_in_fp32

    cfg = dict(CONFIG, pos_embed_seq_len=514 if flf2v else None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        theirs = diffusers.WanTransformer3DModel(**cfg).to(torch.bfloat16).eval()
    for name, prm in theirs.named_parameters():
        if keep_in_fp32(name):
            prm.data = prm.data.float()
    state = theirs.state_dict()
    att = AttentionDispatch.resolve("FLASH_ATTN", device="cuda", dtype=torch.bfloat16, head_dim=128)
    wcfg = WanConfig.from_dict({"_class_name": "WanTransformer3DModel", **cfg})

    def build(options):
        with torch.device("meta"):
            m = WanTransformer(wcfg, att, options=options.resolve("cuda", torch.bfloat16))
        m.load_state_dict(state, assign=True, strict=True)
        return m.eval()

    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(1, 36, 5, 30, 52, device="cuda", generator=g).bfloat16()
    t = torch.tensor([700.0], device="cuda")
    text = torch.randn(1, 512, 4096, device="cuda", generator=g).bfloat16()
    text[:, 20:] = 0  # a 20-token prompt: collapsed padding and the folded projection on the fast build
    image = torch.randn(2 if flf2v else 1, 257, 1280, device="cuda", generator=g).bfloat16()
    return theirs, build, (x, t, text, image)


def _fp32(model):
    from fastwan.attention import AttentionDispatch

    ref32 = copy.deepcopy(model).float()
    ref32.set_attention(AttentionDispatch.resolve("TORCH_SDPA", device="cuda", dtype=torch.float32, head_dim=128))
    return ref32


@torch.no_grad()
@pytest.mark.parametrize("flf2v", [False, True])
def test_image_tokens_fast_build_as_close_to_fp32_as_the_reference(flf2v):
    from fastwan.options import DiTOptions

    torch._dynamo.reset()
    _, build, (x, t, text, image) = _setup(flf2v)
    uncond = torch.zeros_like(text)
    uncond[:, :7] = text[:, :7].flip(-1)
    model = build(DiTOptions(block="reference"))
    ref32 = _fp32(model)
    exact = ref32(x.float(), t, text.float(), image=image.float()).double()
    exact_u = ref32(x.float(), t, uncond.float(), image=image.float()).double()
    del ref32
    fast = build(DiTOptions(block="fast"))
    fast.compile_blocks(fullgraph=True)
    err = {"reference bf16": _rel(model(x, t, text, image=image), exact),
           "fast": _rel(fast(x, t, text, image=image), exact)}
    for batched in (True, False):
        c, u = fast.forward_cfg(x, t, text, uncond, batched=batched, image=image)
        err[f"fast cfg batched={batched}"] = max(_rel(c, exact), _rel(u, exact_u))
    print(f"flf2v={flf2v}, rel L2 vs fp32:", {k: f"{v:.3e}" for k, v in err.items()})
    base = err["reference bf16"]
    assert base <= 3e-2 and all(v <= max(1.25 * base, 1e-2) for v in err.values()), err
    torch._dynamo.reset()


@torch.no_grad()
@pytest.mark.parametrize("flf2v", [False, True])
def test_image_tokens_against_diffusers_bf16(flf2v):
    """fastwan's default build (fast, compiled) and diffusers' model on the same bf16 weights: fastwan no further
    from fp32 than diffusers (both round in bf16, at other points), and close to diffusers."""
    from fastwan.options import DiTOptions

    torch._dynamo.reset()
    theirs, build, (x, t, text, image) = _setup(flf2v)
    ref32 = _fp32(build(DiTOptions(block="reference")))
    exact = ref32(x.float(), t, text.float(), image=image.float()).double()
    del ref32
    fast = build(DiTOptions())
    fast.compile_blocks(fullgraph=True)
    ours = fast(x, t, text, image=image)
    peer = theirs(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
    err = {"fastwan vs fp32": _rel(ours, exact), "diffusers vs fp32": _rel(peer, exact),
           "fastwan vs diffusers": _rel(ours, peer)}
    print(f"flf2v={flf2v}:", {k: f"{v:.3e}" for k, v in err.items()})
    assert err["fastwan vs fp32"] <= max(1.25 * err["diffusers vs fp32"], 1e-2), err
    assert err["fastwan vs diffusers"] <= 3e-2, err
    torch._dynamo.reset()
