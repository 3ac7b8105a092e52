"""GPU: a CUDA load sets torch's fp32 math as fp32_precision says, and an fp32 VAE decode under TF32 stays within
TF32's error of the full-fp32 decode (frames within a few levels)."""
import numpy as np
import pytest
import torch

from fastwan import VideoGenerator

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_loads_set_fp32_math(tiny_ckpts):
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    try:
        frames = {}
        for precision in ("ieee", "tf32"):
            gen = VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cuda", dtype=torch.float32,
                                                 fp32_precision=precision)
            assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == (
                precision, precision)
            frames[precision] = gen.generate_video("a lighthouse", seed=3, height=64, width=64, num_frames=9,
                                                   num_inference_steps=4, save_video=False).frames
        diff = np.abs(frames["tf32"].astype(int) - frames["ieee"].astype(int))
        print(f"tf32 vs ieee frames: max |diff| {diff.max()}, mean {diff.mean():.4f}")
        assert diff.max() <= 8
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved
