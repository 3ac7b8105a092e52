"""A DiT block compiles with fullgraph=True (no graph breaks) and matches eager; the generator's compile flag."""
import numpy as np
import pytest
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


SPARSE_CASES = [
    ("SLIDING_TILE_ATTN", {"tile": [2, 2, 2], "window": [3, 3, 3]}),
    ("VIDEO_SPARSE_ATTN", {"tile": [2, 2, 2], "sparsity": 0.5}),
    ("NEIGHBORHOOD_ATTN", {"kernel_size": [3, 3, 3], "tile": [2, 2, 2]}),
]


@pytest.mark.parametrize("name,conf", SPARSE_CASES, ids=[c[0] for c in SPARSE_CASES])
def test_generator_compile_with_sparse_backend(tiny_ckpts, name, conf):
    """Compiled blocks + a sparse backend (attention is a graph break) give the eager frames."""
    torch._dynamo.reset()
    kw = dict(height=48, width=80, num_frames=9, num_inference_steps=2, seed=3, save_video=False)
    common = dict(device="cpu", dtype=torch.float32, attention_backend=name, attention_config=conf)
    eager = VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], **common)
    comp = VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], enable_torch_compile=True,
                                          torch_compile_kwargs={"backend": "aot_eager"}, **common)
    a = eager.generate_video("a kite", **kw).frames
    b = comp.generate_video("a kite", **kw).frames
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1


def test_sparse_backend_with_fullgraph_raises(tiny_ckpts):
    with pytest.raises(ValueError, match="fullgraph=True cannot be used with the sparse backend"):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32,
                                       attention_backend="SLIDING_TILE_ATTN", enable_torch_compile=True,
                                       torch_compile_kwargs={"fullgraph": True})


@pytest.mark.parametrize("kw,match", [({"enable_torch_compile": None}, "must be True or False"),
                                      ({"dit_options": {"block": "fast"}}, "must be a fastwan.options.DiTOptions")])
def test_build_arguments_are_type_checked(kw, match):
    with pytest.raises(TypeError, match=match):
        VideoGenerator.from_pretrained("tiny", device="cpu", **kw)
