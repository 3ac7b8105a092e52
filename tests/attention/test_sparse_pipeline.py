"""The whole pipeline runs with each sparse backend on a tiny model, at sizes the tiles do not divide."""
import numpy as np
import pytest
import torch

from fastwan import VideoGenerator

CONFIGS = {
    "SLIDING_TILE_ATTN": {"tile": [2, 2, 2], "window": [1, 3, 3], "dense_steps": 1},
    "NEIGHBORHOOD_ATTN": {"kernel_size": [3, 3, 3], "tile": [2, 2, 2]},
    "VIDEO_SPARSE_ATTN": {"tile": [2, 2, 2], "sparsity": 0.5},
}


@pytest.mark.parametrize("variant", ["wan2.1", "wan2.2-ti2v"])
@pytest.mark.parametrize("backend", sorted(CONFIGS))
def test_pipeline_with_sparse_backend(tiny_ckpts, backend, variant):
    size = {"height": 96, "width": 160, "num_frames": 9}  # token grid 3 x 6 x 10 (TI2V: 3 x 3 x 5)
    gen = VideoGenerator.from_pretrained(tiny_ckpts[variant], device="cpu", dtype=torch.float32,
                                         attention_backend=backend, attention_config=CONFIGS[backend])
    res = gen.generate_video("a lighthouse at night", seed=2, num_inference_steps=3, save_video=False, **size)
    dense = VideoGenerator.from_pretrained(tiny_ckpts[variant], device="cpu", dtype=torch.float32)
    ref = dense.generate_video("a lighthouse at night", seed=2, num_inference_steps=3, save_video=False, **size)
    assert res.frames.shape == ref.frames.shape == (9, 96, 160, 3)
    assert backend in res.attention_backend
    assert np.isfinite(res.frames).all() and res.frames.std() > 1
    assert not np.array_equal(res.frames, ref.frames)  # sparsity really changed the attention


def test_config_without_backend_raises(tiny_ckpts):
    with pytest.raises(ValueError, match="no attention backend was named"):
        VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", attention_config={"window": [3, 3, 3]})
