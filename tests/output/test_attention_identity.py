"""The automatic file name tells apart videos that an attention setting makes different: two sparsity levels of one
sparse backend give different videos, so with overwrite=True neither replaces the other."""
import numpy as np
import torch

from fastwan import VideoGenerator


def test_attention_settings_change_the_automatic_name(tiny_ckpts, tmp_path):
    kw = dict(seed=0, height=128, width=128, num_frames=17, num_inference_steps=2, output_path=tmp_path,
              overwrite=True)
    results = []
    for sparsity in (0.5, 0.9):
        gen = VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32,
                                             attention_backend="VIDEO_SPARSE_ATTN",
                                             attention_config={"sparsity": sparsity})
        results.append(gen.generate_video("a cat", **kw))
    a, b = results
    assert np.abs(a.frames.astype(int) - b.frames.astype(int)).max() > 0  # different videos
    assert a.video_path != b.video_path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.rsplit("/", 1)[-1] for p in (a.video_path, b.video_path))
