"""A DiT block compiles with fullgraph=True (no graph breaks) and matches eager; the generator's compile flag."""
import numpy as np
import torch

from fastwan import VideoGenerator
from fastwan.attention import AttentionDispatch
from fastwan.models import load_transformer


def test_block_fullgraph_matches_eager(tiny_ckpts):
    torch._dynamo.reset()
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    model = load_transformer(tiny_ckpts["wan2.1"] / "transformer", dtype=torch.float32, device="cpu", attention=attn)
    x = torch.randn(1, 16, 3, 8, 8)
    t = torch.tensor([700.0])
    text = torch.randn(1, 9, 32)
    with torch.no_grad():
        want = model(x, t, text)
        for blk in model.blocks:
            blk.compile(fullgraph=True, backend="aot_eager")  # fullgraph: any graph break raises
        got = model(x, t, text)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_generator_compile_flag(tiny_ckpts):
    torch._dynamo.reset()
    kw = dict(height=32, width=32, num_frames=5, num_inference_steps=2, seed=1, save_video=False)
    eager = VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32)
    comp = VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32,
                                          enable_torch_compile=True,
                                          torch_compile_kwargs={"fullgraph": True, "backend": "aot_eager"})
    a = eager.generate_video("a kite", **kw).frames
    b = comp.generate_video("a kite", **kw).frames
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
