"""Every Wan LoRA key spelling diffusers' ``WanPipeline`` / ``WanImageToVideoPipeline.load_lora_weights`` reads,
merged by fastwan (``VideoGenerator.load_lora``) into the tiny Wan DiTs (T2V, I2V, FLF2V, TI2V, A14B), against
diffusers' own merge (``load_lora_weights`` + ``fuse_lora``) of the same file: every weight and bias, fp32, to 1e-6
relative.

Spellings: the original Wan / ComfyUI / lightx2v keys (``diffusion_model.``; lora_down / lora_up or lora_A /
lora_B, alpha, diff_b, ``head.head.diff``; FP8-stored; lightx2v's norm and modulation deltas, which neither side
merges) on every layer diffusers maps (time_projection, head, text / time embeddings, the I2V / FLF2V image embedder
and k_img / v_img; Wan2.2 TI2V-5B too); diffusers / PEFT keys on every layer (the patch embedding's
convolution too), with ``lora_B.bias``, metadata alphas, mixed ranks, diffusers' older ``lora.down`` and
attention-processor spellings (a DoRA's ``to_out.lora_magnitude_vector`` too), a T2V LoRA on the I2V model, a Wan2.2
A14B expert's LoRA against ``load_into_transformer_2``, and PEFT DoRAs (magnitudes; at scales 1.0 and 0.7,
after a plain LoRA, on FP8 layers against a float64 hand computation). Where diffusers drops a delta it cannot express
(full-weight ``diff`` keys, a time_projection ``diff_b`` without its weights) or misreads a spelling (PEFT's
adapter names), fastwan's merge is checked against a hand computation / diffusers' merge of the plain spelling."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from fastwan import VideoGenerator
from fastwan.kernels.fp8 import Fp8Linear
from fastwan.checkpoint.tiny import tiny_checkpoint

pytest.importorskip("peft")
SCALE = 0.7
# (diffusers module, original Wan module): the block linears, the I2V image cross-attention, the layers outside
# the blocks that diffusers' converter maps, and the I2V image embedder's
BLOCK = [("attn1.to_q", "self_attn.q"), ("attn1.to_k", "self_attn.k"), ("attn1.to_v", "self_attn.v"),
         ("attn1.to_out.0", "self_attn.o"), ("attn2.to_q", "cross_attn.q"), ("attn2.to_k", "cross_attn.k"),
         ("attn2.to_v", "cross_attn.v"), ("attn2.to_out.0", "cross_attn.o"), ("ffn.net.0.proj", "ffn.0"),
         ("ffn.net.2", "ffn.2")]
IMAGE = [("attn2.add_k_proj", "cross_attn.k_img"), ("attn2.add_v_proj", "cross_attn.v_img")]
TOP = [("condition_embedder.time_proj", "time_projection.1"), ("proj_out", "head.head"),
       ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
       ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
       ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
       ("condition_embedder.time_embedder.linear_2", "time_embedding.2")]
TOP_IMAGE = [("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
             ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3")]
VARIANTS = {"t2v": "wan2.1", "i2v": "wan2.1-i2v", "flf2v": "wan2.1-flf2v", "ti2v": "wan2.2-ti2v"}
# the original Wan norm names (their deltas: zeros in the files that carry them, merged by neither side)
WAN_NORMS = ("self_attn.norm_q", "self_attn.norm_k", "cross_attn.norm_q", "cross_attn.norm_k", "norm3")


@pytest.fixture(scope="module")
def gens():
    return {v: VideoGenerator.from_pretrained(str(tiny_checkpoint(v)), device="cpu", dtype=torch.float32)
            for v in VARIANTS.values()}


class Lora:
    """A random LoRA under construction on one tiny DiT (shapes read from fastwan's model of it)."""

    def __init__(self, model, seed=0):
        self.mods = dict(model.named_modules())
        self.blocks = len(model.blocks)
        self.image = "blocks.0.attn2.add_k_proj" in self.mods
        self.g = torch.Generator().manual_seed(seed)
        self.sd: dict[str, torch.Tensor] = {}
        self.hand: dict[str, torch.Tensor] = {}  # parameter -> the delta diffusers drops, merged as written

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g) * 0.3

    def modules(self, blocks=True, image=None, top=False):
        image = self.image if image is None else image
        out = [(f"blocks.{i}.{d}", f"blocks.{i}.{w}") for i in range(self.blocks) if blocks
               for d, w in BLOCK + (IMAGE if image else [])]
        return out + (TOP + (TOP_IMAGE if image else []) if top else [])

    def add(self, modules, prefix, down="lora_down", up="lora_up", wan=True, rank=4, alpha=None, diff_b=(),
            bias=()):
        """Parts of ``modules`` under ``prefix`` (original names when ``wan``); ``alpha``: x 1.0, 1.1, ... per
        module; ``diff_b`` / ``bias``: the modules (by a part of their name) given a diff_b / lora_B.bias."""
        for j, (ours, original) in enumerate(modules):
            w = self.mods[ours].weight
            key = prefix + (original if wan else ours)
            self.sd[f"{key}.{down}.weight"] = self.randn(rank, *w.shape[1:])
            self.sd[f"{key}.{up}.weight"] = self.randn(w.shape[0], rank, *[1] * (w.dim() - 2))
            if alpha is not None:
                self.sd[f"{key}.alpha"] = torch.tensor(alpha * (1 + j / 10))
            if any(p in ours for p in diff_b):
                self.sd[f"{key}.diff_b"] = self.randn(w.shape[0])
            if any(p in ours for p in bias):
                self.sd[f"{key}.lora_B.bias"] = self.randn(w.shape[0])
        return self

    def dropped(self, key, param):
        """A delta (``key``, the shape of ``param``) that diffusers drops and fastwan merges as written."""
        self.sd[key] = self.hand[param] = self.randn(*self.mods[""].get_parameter(param).shape)
        return self


def peft_meta(sd, **config):
    """diffusers' pipeline-save metadata (a LoraConfig under 'transformer.') for the PEFT keys of ``sd``."""
    targets = sorted({k[len("transformer."):].split(".lora")[0] for k in sd if k.startswith("transformer.")})
    config = {"r": 4, "target_modules": targets, "use_dora": False, "use_rslora": False, **config}
    return {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}


def case_wan_lora_ab_alpha(lo):  # lightx2v's spelling: original names with lora_A / lora_B and alphas
    lo.add(lo.modules(), "diffusion_model.", "lora_A", "lora_B", alpha=2.0, diff_b=("attn2.to_out", "add_"))


def case_wan_small_alpha(lo):  # alpha / rank < 0.5: diffusers splits the scale between A and B
    lo.add(lo.modules(), "diffusion_model.", alpha=0.3)


def case_wan_outside_blocks(lo):  # CausVid-like: time_projection, head, text / time embeddings with diff_b
    lo.add(lo.modules(top=True), "diffusion_model.", diff_b=("time_proj", "proj_out", "embedder", "attn1", "ffn"))


def case_wan_head_diff(lo):  # lightx2v's head.head.diff with its diff_b (diffusers: lora_A with an identity B)
    lo.add(lo.modules(), "diffusion_model.")
    w = lo.mods["proj_out"].weight
    lo.sd["diffusion_model.head.head.diff"] = lo.randn(*w.shape)
    lo.sd["diffusion_model.head.head.diff_b"] = lo.randn(w.shape[0])


def case_wan_bias_only_module_and_norms(lo):  # a module with only diff_b; zero norm deltas; a modulation diff
    lo.add(lo.modules()[1:], "diffusion_model.")
    lo.sd["diffusion_model.blocks.0.self_attn.q.diff_b"] = lo.randn(lo.mods["blocks.0.attn1.to_q"].weight.shape[0])
    dim = lo.mods["blocks.0.attn1.to_q"].weight.shape[0]
    for key in ("blocks.0.norm3.diff", "blocks.0.norm3.diff_b", "blocks.1.self_attn.norm_q.diff"):
        lo.sd[f"diffusion_model.{key}"] = torch.zeros(dim)
    lo.sd["diffusion_model.blocks.1.modulation.diff"] = lo.randn(1, 6, dim)  # neither side merges it


def case_wan_full_diffs(lo):  # full-weight diff keys and an AccVideo-like time_projection diff_b: diffusers drops
    lo.add([m for m in lo.modules() if m[0] not in ("blocks.0.attn1.to_q", "blocks.1.ffn.net.2")], "diffusion_model.")
    lo.dropped("diffusion_model.blocks.0.self_attn.q.diff", "blocks.0.attn1.to_q.weight")
    lo.dropped("diffusion_model.blocks.1.ffn.2.diff", "blocks.1.ffn.net.2.weight")
    lo.dropped("diffusion_model.time_projection.1.diff_b", "condition_embedder.time_proj.bias")
    lo.dropped("diffusion_model.patch_embedding.diff", "patch_embedding.weight")
    lo.dropped("diffusion_model.patch_embedding.diff_b", "patch_embedding.bias")


def case_wan_fp8_tensors(lo):  # a file stored in FP8 (no alphas: diffusers cannot scale FP8 tensors), zero norms
    lo.add(lo.modules(top=True), "diffusion_model.", diff_b=("attn2", "proj_out", "image_embedder"))
    dim = lo.mods["blocks.0.attn1.to_q"].weight.shape[0]
    lo.sd["diffusion_model.blocks.0.norm3.diff"] = torch.zeros(dim)
    lo.sd.update({k: v.to(torch.float8_e4m3fn) for k, v in lo.sd.items()})


def case_wan_deltas_diffusers_drops(lo):  # lightx2v's: zero norm deltas under every original name, diff_m
    lo.add(lo.modules(), "diffusion_model.", "lora_A", "lora_B", alpha=4.0, diff_b=("attn1", "ffn"))
    lo.add(lo.modules(blocks=False, top=True), "diffusion_model.", "lora_A", "lora_B")  # diffusers: no alphas here
    dim = lo.mods["blocks.0.attn1.to_q"].weight.shape[0]
    for i in range(lo.blocks):
        for norm in WAN_NORMS + (("cross_attn.norm_k_img",) if lo.image else ()):
            lo.sd[f"diffusion_model.blocks.{i}.{norm}.diff"] = torch.zeros(dim)
        lo.sd[f"diffusion_model.blocks.{i}.diff_m"] = lo.randn(1, 6, dim)  # neither side merges them
    lo.sd["diffusion_model.head.diff_m"] = lo.randn(1, 2, dim)
    lo.sd["diffusion_model.head.norm.diff"] = torch.zeros(dim)
    if lo.image:
        image_dim = lo.mods["condition_embedder.image_embedder.ff.net.0.proj"].weight.shape[1]
        for part in ("diff", "diff_b"):
            lo.sd[f"diffusion_model.img_emb.proj.0.{part}"] = torch.zeros(image_dim)
            lo.sd[f"diffusion_model.img_emb.proj.4.{part}"] = torch.zeros(dim)


def case_peft_every_layer(lo):  # diffusers names on every linear and the patch embedding's convolution
    lo.add(lo.modules(top=True) + [("patch_embedding", "")], "transformer.", "lora_A", "lora_B", wan=False)


def case_peft_lora_bias_metadata(lo):  # PEFT's lora_bias, scaled by the metadata's alpha / rank as B @ A is
    lo.add(lo.modules(top=True), "transformer.", "lora_A", "lora_B", wan=False, bias=("to_out", "proj_out"))
    return peft_meta(lo.sd, lora_alpha=8, lora_bias=True, alpha_pattern={"blocks.1.attn2.to_out.0": 2})


def case_peft_conv_metadata(lo):  # the patch embedding's conv LoRA with a metadata alpha
    lo.add(lo.modules()[:4] + [("patch_embedding", "")], "transformer.", "lora_A", "lora_B", wan=False)
    return peft_meta(lo.sd, lora_alpha=2)


def case_peft_mixed_ranks_and_text_encoder(lo):  # rank_pattern; text-encoder keys are not the DiT's
    lo.add(lo.modules()[:6], "transformer.", "lora_A", "lora_B", wan=False, rank=4)
    lo.add(lo.modules()[6:], "transformer.", "lora_A", "lora_B", wan=False, rank=2)
    lo.sd["text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight"] = lo.randn(4, 32)
    lo.sd["text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight"] = lo.randn(32, 4)


def case_diffusers_old_lora_down(lo):  # diffusers' older 'lora.down' / 'lora.up', some keys already lora_A
    lo.add(lo.modules()[:5], "transformer.", "lora.down", "lora.up", wan=False)
    lo.add(lo.modules()[5:], "transformer.", "lora_A", "lora_B", wan=False)


def case_diffusers_attention_processor(lo):  # 'attn1.processor.to_q_lora.down.weight', to_out_lora = to_out.0
    for i in range(lo.blocks):
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out"):
                w = lo.mods[f"blocks.{i}.{attn}.{proj}{'.0' if proj == 'to_out' else ''}"].weight
                key = f"transformer.blocks.{i}.{attn}.processor.{proj}_lora"
                lo.sd[f"{key}.down.weight"], lo.sd[f"{key}.up.weight"] = lo.randn(4, w.shape[1]), lo.randn(
                    w.shape[0], 4)


def case_diffusers_old_spelling_dora(lo):  # 'lora.down' with a DoRA: 'attn1.to_out.lora_magnitude_vector'
    add_magnitudes(lo.add(lo.modules(), "transformer.", "lora_A", "lora_B", wan=False))
    lo.sd = {k.replace(".lora_A.", ".lora.down.").replace(".lora_B.", ".lora.up.")
             .replace(".to_out.0.lora_magnitude_vector", ".to_out.lora_magnitude_vector"): v for k, v in lo.sd.items()}


def case_t2v_lora_on_i2v(lo):  # no image cross-attention keys: diffusers pads them with zeros
    lo.add(lo.modules(image=False), "transformer.", "lora_A", "lora_B", wan=False)


def case_kohya_alpha(lo):  # musubi-tuner: every block module with an alpha
    lo.add([(ours, "lora_unet_" + wan.replace(".", "_")) for ours, wan in lo.modules()], "", alpha=3.0)


CASES = {  # name -> (builder, variants)
    "wan lora_A/lora_B alpha diff_b": (case_wan_lora_ab_alpha, ("t2v", "i2v", "ti2v")),
    "wan small alpha": (case_wan_small_alpha, ("t2v",)),
    "wan outside the blocks": (case_wan_outside_blocks, ("t2v", "i2v", "flf2v", "ti2v")),
    "wan fp8 tensors": (case_wan_fp8_tensors, ("t2v", "i2v")),
    "wan deltas diffusers drops": (case_wan_deltas_diffusers_drops, ("t2v", "i2v")),
    "wan head.head.diff": (case_wan_head_diff, ("t2v",)),
    "wan bias-only module, norms": (case_wan_bias_only_module_and_norms, ("t2v",)),
    "wan full diffs (diffusers drops)": (case_wan_full_diffs, ("t2v",)),
    "peft every layer": (case_peft_every_layer, ("t2v", "i2v", "flf2v", "ti2v")),
    "peft lora_B.bias metadata": (case_peft_lora_bias_metadata, ("t2v", "i2v")),
    "peft conv metadata": (case_peft_conv_metadata, ("t2v",)),
    "peft mixed ranks, text encoder": (case_peft_mixed_ranks_and_text_encoder, ("t2v",)),
    "diffusers lora.down": (case_diffusers_old_lora_down, ("t2v",)),
    "diffusers attention processor": (case_diffusers_attention_processor, ("t2v",)),
    "diffusers old spelling dora": (case_diffusers_old_spelling_dora, ("t2v",)),
    "t2v lora on i2v": (case_t2v_lora_on_i2v, ("i2v",)),
    "kohya alpha": (case_kohya_alpha, ("t2v", "i2v")),
}
PARAMS = [pytest.param(name, kind, id=f"{name}-{kind}") for name, (_, kinds) in CASES.items() for kind in kinds]


def diffusers_fused(variant, path, scale):
    """(weights before, after) of diffusers' DiT: ``load_lora_weights`` on its pipeline, fused and unloaded."""
    from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel

    t = WanTransformer3DModel.from_pretrained(tiny_checkpoint(variant) / "transformer", torch_dtype=torch.float32)
    before = {k: v.clone() for k, v in t.state_dict().items()}
    image = "i2v" in variant or "flf2v" in variant
    cls = WanImageToVideoPipeline if image else WanPipeline
    pipe = cls(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=t,
               **({"image_encoder": None, "image_processor": None} if image else {}))
    pipe.load_lora_weights(str(path), adapter_name="x", low_cpu_mem_usage=False)
    pipe.fuse_lora(lora_scale=scale, components=["transformer"])
    pipe.unload_lora_weights()
    return before, pipe.transformer.state_dict()


def fastwan_merged(gen, path, scale):
    model = gen.transformers[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gen.load_lora(path, scale)
    try:
        return before, {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        gen.unload_lora()
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def assert_same_merge(ours, want, hand=None, scale=SCALE):
    """fastwan's merged weights (``ours``: before, after) equal diffusers' (``want``), and the deltas diffusers drops
    (``hand``: parameter -> delta) are merged as W + scale x delta, each to 1e-6 of its largest value."""
    (b0, got), (w0, ref) = ours, want
    hand = hand or {}
    changed = {k for k in ref if not torch.equal(ref[k], w0[k])} | {k for k in got if not torch.equal(got[k], b0[k])}
    changed |= set(hand)
    assert changed and changed <= set(got) and changed <= set(ref), sorted(set(changed) - set(got) - set(ref))
    for k in sorted(changed):
        expect = b0[k] + scale * hand[k] if k in hand else ref[k]
        if k in hand:
            assert torch.equal(ref[k], w0[k]), f"{k}: diffusers merges it now; compare with diffusers"
        assert (expect - b0[k]).abs().max() > 1e-3, k  # the LoRA changes it
        torch.testing.assert_close(got[k], expect, rtol=0, atol=1e-6 * float(expect.abs().max()), msg=k)


@pytest.mark.parametrize("name, kind", PARAMS)
def test_lora_format_merges_as_diffusers_does(gens, tmp_path, name, kind):
    variant = VARIANTS[kind]
    gen = gens[variant]
    lo = Lora(gen.transformers[0])
    meta = CASES[name][0](lo)
    path = tmp_path / "lora.safetensors"
    save_file(lo.sd, str(path), metadata=meta)
    assert_same_merge(fastwan_merged(gen, path, SCALE), diffusers_fused(variant, path, SCALE), lo.hand)


@pytest.mark.parametrize("spelling", ["adapter name", "processor"])
def test_spellings_diffusers_misreads_merge_as_their_plain_spelling(gens, tmp_path, spelling):
    """PEFT's in-memory keys (``lora_A.default.weight``: diffusers loads nothing) and one attention-processor key
    in a file whose first key is lora_A (diffusers skips converting it and merges a random lora_A): fastwan merges
    them as diffusers merges the same file in the plain spelling."""
    gen = gens["wan2.1"]
    lo = Lora(gen.transformers[0])
    lo.add(lo.modules(), "transformer.", "lora_A", "lora_B", wan=False)
    plain, odd = tmp_path / "plain.safetensors", tmp_path / "odd.safetensors"
    save_file(lo.sd, str(plain))
    if spelling == "adapter name":
        sd = {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
              for k, v in lo.sd.items()}
    else:
        sd = {k.replace("blocks.1.attn1.to_v.", "blocks.1.attn1.processor.to_v."): v for k, v in lo.sd.items()}
    save_file(sd, str(odd))
    assert_same_merge(fastwan_merged(gen, odd, SCALE), diffusers_fused("wan2.1", plain, SCALE))


def test_fp8_lora_with_alphas_merges_as_its_values_do(gens, tmp_path):
    """A file stored in FP8 with alphas (diffusers' converter cannot scale FP8 tensors: "not implemented") merges as
    diffusers merges the same values stored in fp32."""
    gen = gens["wan2.1-i2v"]
    lo = Lora(gen.transformers[0], seed=6)
    lo.add(lo.modules(), "diffusion_model.", alpha=3.0, diff_b=("attn2",))
    lo.add(lo.modules(blocks=False, top=True), "diffusion_model.", diff_b=("proj_out",))  # diffusers: no alphas here
    lo.sd["diffusion_model.blocks.0.norm3.diff"] = torch.zeros(lo.mods["blocks.0.attn1.to_q"].weight.shape[0])
    fp8 = {k: v.to(torch.float8_e4m3fn) for k, v in lo.sd.items()}
    plain, odd = tmp_path / "fp32.safetensors", tmp_path / "fp8.safetensors"
    save_file({k: v.float() for k, v in fp8.items()}, str(plain))
    save_file(fp8, str(odd))
    assert_same_merge(fastwan_merged(gen, odd, SCALE), diffusers_fused("wan2.1-i2v", plain, SCALE))


def test_deltas_diffusers_drops_are_named_as_what_they_are(gens, tmp_path, caplog):
    """lightx2v's norm deltas under their original names (zeros) pass quietly, as zero norm deltas under diffusers'
    names do, instead of being reported as keys of no layer; its modulation deltas (``blocks.N.diff_m``,
    ``head.diff_m``, ``modulation.diff``), which diffusers drops, are named in a warning as such; a file of such
    deltas only would change nothing and raises."""
    import logging

    from fastwan.errors import InvalidArgument

    gen = gens["wan2.1-i2v"]
    lo = Lora(gen.transformers[0], seed=7)
    case_wan_deltas_diffusers_drops(lo)
    path = tmp_path / "lightx2v.safetensors"
    save_file(lo.sd, str(path))
    caplog.set_level(logging.WARNING, logger="fastwan")
    fastwan_merged(gen, path, SCALE)
    assert "name no layer" not in caplog.text and "norm deltas" not in caplog.text
    assert f"{lo.blocks + 1} deltas of parameters outside the layers (modulation tables" in caplog.text
    assert "diffusion_model.blocks.0.diff_m" in caplog.text
    only = tmp_path / "only.safetensors"
    dim, image_dim = (lo.sd[f"diffusion_model.{k}.diff_b"].shape for k in ("img_emb.proj.4", "img_emb.proj.0"))
    save_file({"diffusion_model.blocks.0.cross_attn.norm_k_img.diff": torch.ones(dim),
               "diffusion_model.img_emb.proj.0.diff_b": torch.ones(image_dim),
               "diffusion_model.blocks.1.modulation.diff": torch.ones(1, 6, *dim)}, str(only))
    with pytest.raises(InvalidArgument, match=r"its 3 keys are all modulation or norm deltas.*does not merge"):
        gen.load_lora(only)


# -- PEFT DoRA: lora_A / lora_B with a magnitude per output feature ------------------------------------------------
def add_magnitudes(lo, suffix=""):
    """A DoRA magnitude for every lora_A module of ``lo.sd``: its weight's norm per output feature x 0.5 .. 1.5, shaped
    as PEFT saves it ([out]; a convolution's [1, out, 1, 1, 1]); ``suffix`` after 'lora_magnitude_vector'."""
    for key in [k for k in lo.sd if k.endswith(".lora_A.weight")]:
        module = key[: -len(".lora_A.weight")]
        layer = lo.mods[module.split(".", 1)[1]]
        w = layer.weight.float() * (layer.weight_scale[:, None] if hasattr(layer, "weight_scale") else 1)  # FP8
        m = w.flatten(1).norm(dim=1) * (0.5 + torch.rand(w.shape[0], generator=lo.g))
        lo.sd[f"{module}.lora_magnitude_vector{suffix}"] = m if w.dim() == 2 else m.view(1, -1, *[1] * (w.dim() - 2))
    return lo


def block_dora(model, seed, **kw):
    """A PEFT DoRA (diffusers' saved spelling) on every block linear of ``model``."""
    lo = Lora(model, seed)
    return add_magnitudes(lo.add(lo.modules(), "transformer.", "lora_A", "lora_B", wan=False, **kw))


def dora(lo, suffix="", **config):
    """A PEFT DoRA on every linear and the patch embedding (PEFT gives a DoRA no lora_bias)."""
    lo.add(lo.modules(top=True) + [("patch_embedding", "")], "transformer.", "lora_A", "lora_B", wan=False)
    add_magnitudes(lo, suffix)
    return peft_meta(lo.sd, use_dora=True, **config) if config else None


@pytest.mark.parametrize("scale", [1.0, 0.7])
@pytest.mark.parametrize("kind, suffix, config", [
    ("t2v", "", {"lora_alpha": 8, "alpha_pattern": {"blocks.1.attn2.to_out.0": 2}}),  # a pipeline save
    ("t2v", ".weight", {}),  # no metadata: alpha = rank; '.weight' after the magnitude, as diffusers reads it too
    ("i2v", "", {"lora_alpha": 2}),
])
def test_peft_dora_merges_as_diffusers_does(gens, tmp_path, kind, suffix, config, scale):
    """W <- m / ||W + D|| x (W + D) per output feature, D = scale x alpha / rank x B @ A (PEFT's merge at
    fuse_lora's lora_scale); unloading restores every weight bit for bit (fastwan_merged checks it)."""
    variant = VARIANTS[kind]
    lo = Lora(gens[variant].transformers[0], seed=1)
    meta = dora(lo, suffix, **config)
    path = tmp_path / "dora.safetensors"
    save_file(lo.sd, str(path), metadata=meta)
    want = diffusers_fused(variant, path, scale)
    assert_same_merge(fastwan_merged(gens[variant], path, scale), want, scale=scale)
    plain = tmp_path / "plain.safetensors"  # the magnitudes matter: without them the merge is another one
    save_file({k: v for k, v in lo.sd.items() if "magnitude" not in k}, str(plain),
              metadata=peft_meta(lo.sd, **config) if config else None)
    key = "blocks.0.attn1.to_q.weight"
    assert (fastwan_merged(gens[variant], plain, scale)[1][key] - want[1][key]).abs().max() > 1e-3


@pytest.mark.parametrize("spelling", ["adapter name", "original names"])
def test_dora_spellings_diffusers_refuses_merge_as_the_peft_spelling(gens, tmp_path, spelling):
    """PEFT's in-memory magnitude key (``lora_magnitude_vector.default.weight``: diffusers keeps its own initial
    magnitude) and a DoRA under the original Wan names (``diffusion_model.``: diffusers' converter raises) merge as
    diffusers merges the file in PEFT's saved spelling."""
    gen = gens["wan2.1"]
    lo = block_dora(gen.transformers[0], seed=2)
    plain, odd = tmp_path / "plain.safetensors", tmp_path / "odd.safetensors"
    save_file(lo.sd, str(plain))
    if spelling == "adapter name":
        sd = {k.replace("lora_magnitude_vector", "lora_magnitude_vector.default.weight"): v for k, v in lo.sd.items()}
    else:
        sd = {k: v for k, v in lo.sd.items()}
        for ours, original in lo.modules():
            for part in ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector"):
                sd[f"diffusion_model.{original}.{part}"] = sd.pop(f"transformer.{ours}.{part}")
    save_file(sd, str(odd))
    assert_same_merge(fastwan_merged(gen, odd, SCALE), diffusers_fused("wan2.1", plain, SCALE))


def test_dora_after_a_lora_merges_as_diffusers_fuses_both(gens, tmp_path):
    """A plain LoRA, then a DoRA on the same layers: PEFT takes the DoRA's norm from the weight without the LoRA
    (diffusers: both adapters loaded, fused together)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    gen = gens["wan2.1"]
    first = Lora(gen.transformers[0], seed=3)
    first.add(first.modules(), "transformer.", "lora_A", "lora_B", wan=False)
    second = block_dora(gen.transformers[0], seed=4)
    paths = [tmp_path / "lora.safetensors", tmp_path / "dora.safetensors"]
    for lo, path in zip((first, second), paths):
        save_file(lo.sd, str(path))
    t = WanTransformer3DModel.from_pretrained(tiny_checkpoint("wan2.1") / "transformer", torch_dtype=torch.float32)
    before = {k: v.clone() for k, v in t.state_dict().items()}
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=t)
    for name, path in zip("ab", paths):
        pipe.load_lora_weights(str(path), adapter_name=name, low_cpu_mem_usage=False)
    pipe.set_adapters(["a", "b"])
    pipe.fuse_lora(lora_scale=SCALE, components=["transformer"], adapter_names=["a", "b"])
    pipe.unload_lora_weights()
    model = gen.transformers[0]
    ours = {k: v.clone() for k, v in model.state_dict().items()}
    for path in paths:
        gen.load_lora(path, SCALE)
    try:
        assert_same_merge((ours, {k: v.clone() for k, v in model.state_dict().items()}),
                          (before, pipe.transformer.state_dict()))
    finally:
        gen.unload_lora()
    assert all(torch.equal(ours[k], v) for k, v in model.state_dict().items())


def test_fp8_dora_merges_requantized_and_unloads_bit_for_bit(tmp_path):
    """On FP8 layers: the dequantized weight W, m / ||W + D|| x (W + D) computed here in float64, quantized again
    per output feature (scale amax / 448); unloading restores the FP8 weights and scales bit for bit."""
    gen = VideoGenerator.from_pretrained(str(tiny_checkpoint("wan2.1")), device="cpu", dtype=torch.float32,
                                         quantization="fp8")
    model = gen.transformers[0]
    lo = block_dora(model, seed=5, alpha=2.0)
    path = tmp_path / "dora.safetensors"
    save_file(lo.sd, str(path))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gen.load_lora(path, SCALE)
    for j, (name, _) in enumerate(lo.modules()):
        lin, key = lo.mods[name], f"transformer.{name}"
        assert isinstance(lin, Fp8Linear), name
        w = before[f"{name}.weight"].double() * before[f"{name}.weight_scale"].double()[:, None]
        a, b = lo.sd[f"{key}.lora_A.weight"].double(), lo.sd[f"{key}.lora_B.weight"].double()
        merged = w + SCALE * 2.0 * (1 + j / 10) / a.shape[0] * (b @ a)
        want = lo.sd[f"{key}.lora_magnitude_vector"].double()[:, None] / merged.norm(dim=1, keepdim=True) * merged
        torch.testing.assert_close(lin.weight_scale.double(), want.abs().amax(dim=1) / 448.0, rtol=1e-6, atol=0)
        w8 = (want / lin.weight_scale.double()[:, None]).float().to(torch.float8_e4m3fn)
        assert torch.equal(lin.weight.view(torch.uint8), w8.view(torch.uint8)), name
    gen.unload_lora()
    for k, v in model.state_dict().items():
        assert torch.equal(before[k].view(torch.uint8), v.view(torch.uint8)) if v.dtype == torch.float8_e4m3fn \
            else torch.equal(before[k], v), k
