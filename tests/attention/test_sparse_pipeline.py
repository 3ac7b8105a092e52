"""The whole pipeline runs with each sparse backend on a tiny model, at sizes the tiles do not divide; image to
video with a sparse backend gives the same frames in both CFG modes."""
import numpy as np
import pytest
import torch
from PIL import Image

from fastwan import VideoGenerator

CONFIGS = {
    "SLIDING_TILE_ATTN": {"tile": [2, 2, 2], "window": [1, 3, 3], "dense_steps": 1},
    "NEIGHBORHOOD_ATTN": {"kernel_size": [3, 3, 3], "tile": [2, 2, 2]},
    "VIDEO_SPARSE_ATTN": {"tile": [2, 2, 2], "sparsity": 0.5},
}
RUN = dict(height=64, width=64, num_frames=5, num_inference_steps=3, guidance_scale=5.0, seed=3, save_video=False)


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


# -- image-to-video -------------------------------------------------------------------------------------------------
def frames(gen, **kw) -> np.ndarray:
    return gen.generate_video("a fox in the snow", negative_prompt="blurry", **{**RUN, **kw}).frames.astype(int)


def load(model="tiny", **kw) -> VideoGenerator:
    return VideoGenerator.from_pretrained(model, device="cpu", dtype=torch.float32, **kw)


def images(n: int) -> list:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.mark.parametrize("model,backend,config", [
    ("tiny-wan2.1-flf2v", "SLIDING_TILE_ATTN", {"tile": [2, 2, 2]}),
    ("tiny-wan2.2-i2v-a14b", "VIDEO_SPARSE_ATTN", {"tile": [2, 2, 2], "sparsity": 0.5}),
    ("tiny-wan2.2-ti2v", "VIDEO_SPARSE_ATTN", {"tile": [2, 2, 2], "sparsity": 0.5}),
])
def test_image_to_video_with_a_sparse_backend_same_in_both_cfg_modes(model, backend, config):
    first, last = images(2)
    kw = dict(image=first, last_image=last) if "flf2v" in model else dict(image=first)
    out = {mode: frames(load(model, attention_backend=backend, attention_config=config, cfg_mode=mode), **kw)
           for mode in ("batched", "sequential")}
    assert np.array_equal(out["batched"], out["sequential"])
