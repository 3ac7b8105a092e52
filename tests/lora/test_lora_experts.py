"""Wan2.2 A14B: a LoRA for one expert, merged by fastwan (``load_lora(expert=1)``) against diffusers'
``load_lora_weights(load_into_transformer_2=True)`` + ``fuse_lora`` of the same file (the helpers of
test_lora_formats)."""
import torch
from safetensors.torch import save_file

from fastwan import VideoGenerator
from fastwan.checkpoint.tiny import tiny_checkpoint
from tests.lora.test_lora_formats import SCALE, Lora, assert_same_merge


def test_a14b_expert_lora_merges_as_load_into_transformer_2(tmp_path):
    """Wan2.2 A14B: ``load_lora(expert=1)`` merges into the low-noise DiT only, as diffusers'
    ``load_lora_weights(load_into_transformer_2=True)`` fuses into ``transformer_2``, in the original Wan layout
    (alphas, diff_b, the layers outside the blocks) and PEFT's."""
    from diffusers import WanPipeline, WanTransformer3DModel

    gen = VideoGenerator.from_pretrained(str(tiny_checkpoint("wan2.2-a14b")), device="cpu", dtype=torch.float32)
    for layout in ("wan", "peft"):
        lo = Lora(gen.transformers[1], seed=8)
        if layout == "wan":
            lo.add(lo.modules(), "diffusion_model.", alpha=2.0, diff_b=("attn2", "ffn"))
            lo.add(lo.modules(blocks=False, top=True), "diffusion_model.", diff_b=("proj_out",))
        else:
            lo.add(lo.modules(top=True), "transformer.", "lora_A", "lora_B", wan=False, bias=("to_out",))
        path = tmp_path / f"{layout}.safetensors"
        save_file(lo.sd, str(path))
        high = {k: v.clone() for k, v in gen.transformers[0].state_dict().items()}
        before = {k: v.clone() for k, v in gen.transformers[1].state_dict().items()}
        gen.load_lora(path, SCALE, expert=1)
        ours = (before, {k: v.clone() for k, v in gen.transformers[1].state_dict().items()})
        assert all(torch.equal(high[k], v) for k, v in gen.transformers[0].state_dict().items())
        gen.unload_lora()
        ckpt = tiny_checkpoint("wan2.2-a14b")
        t1, t2 = (WanTransformer3DModel.from_pretrained(ckpt / sub, torch_dtype=torch.float32)
                  for sub in ("transformer", "transformer_2"))
        w0 = {k: v.clone() for k, v in t2.state_dict().items()}
        pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=t1,
                           transformer_2=t2)
        pipe.load_lora_weights(str(path), adapter_name="low", load_into_transformer_2=True, low_cpu_mem_usage=False)
        pipe.fuse_lora(lora_scale=SCALE, components=["transformer_2"])
        pipe.unload_lora_weights()
        assert_same_merge(ours, (w0, pipe.transformer_2.state_dict()))
