"""FP8 DiT weights (fastwan.models.wan.quantize) on tiny checkpoints, fp32 on the CPU (the "dequant" route).

The reference is independent of fastwan's quantizer: a copy of the checkpoint whose block linear weights (every
2-D ``blocks.*.weight`` in the file) are rounded in float64 to e4m3 with per-row scales amax / 448 by a table
search (tests.kernels.test_fp8.round_e4m3), loaded unquantized. Quantizing while loading must give that model's
predictions, in both block builds; the saved FP8 folder reloads bit for bit; LoRAs merge into FP8 weights by the
requantization rule and unload exactly; inconsistent FP8 files raise."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastwan.attention import AttentionDispatch
from fastwan.errors import CheckpointError, InvalidArgument
from fastwan.kernels.fp8 import E4M3, Fp8Linear
from fastwan.models import load_transformer
from fastwan.models.wan.quantize import save_fp8_transformer
from fastwan.options import DiTOptions
from tests.kernels.test_fp8 import round_e4m3

FAST, REF = DiTOptions(block="fast"), DiTOptions(block="reference")


def rounded_rows(w: torch.Tensor) -> torch.Tensor:
    """w [O, I] -> its per-row e4m3 rounding (scale amax / 448, 1 for zero rows), dequantized, float64."""
    w = w.double()
    amax = w.abs().amax(1, keepdim=True)
    scale = torch.where(amax > 0, (amax.float() / 448).double(), torch.ones_like(amax))  # the fp32 scale
    return round_e4m3(w / scale) * scale


def rounded_copy(src, dst):
    """The checkpoint ``src`` copied to ``dst`` with every 2-D block weight of its transformer(s) replaced by
    :func:`rounded_rows` (stored fp32)."""
    shutil.copytree(src, dst)
    for f in dst.glob("transformer*/*.safetensors"):
        state = load_file(f)
        for k, v in state.items():
            if k.startswith("blocks.") and k.endswith(".weight") and v.dim() == 2:
                state[k] = rounded_rows(v).float()
        save_file(state, f)
    return dst


def build(folder, options=REF, **kw):
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    return load_transformer(folder, dtype=torch.float32, device="cpu", attention=attn, options=options, **kw)


def inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    lat = torch.randn(1, cfg.in_channels, 3, 8, 8, generator=g)
    text = torch.randn(1, 7, cfg.text_dim, generator=g)
    return lat, torch.tensor([700.0]), text


@pytest.fixture(scope="module")
def rounded(tiny_ckpts, tmp_path_factory):
    root = tmp_path_factory.mktemp("rounded")
    return {v: rounded_copy(tiny_ckpts[v], root / v) for v in ("wan2.1", "wan2.2-ti2v")}


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-ti2v"])
@pytest.mark.parametrize("options", [REF, FAST], ids=["reference", "fast"])
def test_fp8_dit_equals_the_dit_with_e4m3_rounded_weights(tiny_ckpts, rounded, variant, options):
    fp8 = build(tiny_ckpts[variant] / "transformer", options, quantization="fp8")
    ref = build(rounded[variant] / "transformer", options)
    plain = build(tiny_ckpts[variant] / "transformer", options)
    args = inputs(fp8)
    with torch.no_grad():
        got, want, unquantized = fp8(*args), ref(*args), plain(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (unquantized - want).abs().max() > 1e-3  # the rounding shows: the comparison can tell


def test_exactly_the_block_linears_are_fp8(tiny_ckpts):
    folder = tiny_ckpts["wan2.1"] / "transformer"
    model = build(folder, quantization="fp8")
    file_linears = {k[: -len(".weight")] for f in folder.glob("*.safetensors") for k, v in load_file(f).items()
                    if k.startswith("blocks.") and k.endswith(".weight") and v.dim() == 2}
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 == file_linears and len(fp8) == 10 * len(model.blocks)
    assert all(m.route == "dequant" for n, m in model.named_modules() if n in fp8)  # CPU: storage only
    assert isinstance(model.condition_embedder.text_embedder.linear_1, torch.nn.Linear)
    assert model.proj_out.weight.dtype == torch.float32 and model.blocks[0].norm2.weight.dtype == torch.float32
    m = model.blocks[0].ffn.net[2]
    assert m.weight.dtype == E4M3 and m.weight_scale.dtype == torch.float32 and m.bias.dtype == torch.float32


def test_saved_fp8_folder_reloads_bit_for_bit(tiny_ckpts, tmp_path):
    src = tiny_ckpts["wan2.2-ti2v"] / "transformer"
    model = build(src, FAST, quantization="fp8")
    out = save_fp8_transformer(model, src / "config.json", tmp_path / "transformer")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    again = build(out, FAST)  # FP8 from the file, no quantization argument
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    args = inputs(model, seed=3)
    with torch.no_grad():
        assert torch.equal(model(*args), again(*args))


def test_inconsistent_fp8_files_raise(tiny_ckpts, tmp_path):
    src = tiny_ckpts["wan2.1"] / "transformer"
    out = save_fp8_transformer(build(src, quantization="fp8"), src / "config.json", tmp_path / "t")
    f = out / "diffusion_pytorch_model.safetensors"
    state = load_file(f)
    scale = state.pop("blocks.0.ffn.net.2.weight_scale")
    save_file(state, f)
    with pytest.raises(CheckpointError, match=r"no FP8 scales for 1 of the rule's layers.*blocks\.0\.ffn\.net\.2"):
        build(out)
    state["blocks.0.ffn.net.2.weight_scale"] = scale
    state["blocks.0.ffn.net.2.weight"] = state["blocks.0.ffn.net.2.weight"].float()  # a scale without FP8 data
    save_file(state, f)
    with pytest.raises(CheckpointError, match=r"ffn\.net\.2\.weight' is float32, but the model holds it as "
                                              r"float8_e4m3fn"):
        build(out)
    with pytest.raises(InvalidArgument, match="quantization='int8' is not supported"):
        build(src, quantization="int8")


def test_lora_on_fp8_is_requantized_and_unloads_exactly(tiny_ckpts):
    from fastwan.lora import LoraState, apply_lora
    from tests.lora.helpers import random_lora

    folder = tiny_ckpts["wan2.1"] / "transformer"
    model = build(folder, quantization="fp8")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = build(folder)
    lora = random_lora(plain, "diffusers", rank=2, seed=5)
    state = LoraState()
    apply_lora([model], [state], "lora.safetensors", 0.7, tensors=lora)
    lin = model.blocks[1].attn1.to_v
    a = lora["transformer.blocks.1.attn1.to_v.lora_A.weight"].double()
    b = lora["transformer.blocks.1.attn1.to_v.lora_B.weight"].double()
    old = before["blocks.1.attn1.to_v.weight"].double() * before["blocks.1.attn1.to_v.weight_scale"].double()[:, None]
    want = rounded_rows((old + 0.7 * (b @ a)).float())  # the merged fp32 weight, quantized again by the rule
    got = lin.weight.double() * lin.weight_scale.double()[:, None]
    torch.testing.assert_close(got, want, rtol=2 ** -20, atol=0)
    assert lin.weight.dtype == E4M3
    state.restore()
    for k, v in model.state_dict().items():
        assert torch.equal(v.view(torch.uint8), before[k].view(torch.uint8)), k
