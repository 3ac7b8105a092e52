"""The conditioning latents of Wan2.2-Animate's pipeline against diffusers' WanAnimatePipeline's own methods
(prepare_reference_image_latents, prepare_prev_segment_cond_latents) on a tiny random Wan VAE: the reference image's,
and a segment's in both modes, first and later."""
from types import SimpleNamespace

import pytest
import torch
from diffusers import AutoencoderKLWan, WanAnimatePipeline

from fastwan.pipelines.animate import plan_segments, reference_latents, segment_latents

H, W = 32, 48


@pytest.fixture(scope="module")
def diffusers_pipe():
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    pipe = SimpleNamespace(vae=vae, vae_scale_factor_temporal=4, vae_scale_factor_spatial=8)
    pipe.get_i2v_mask = lambda *a, **k: WanAnimatePipeline.get_i2v_mask(pipe, *a, **k)
    return pipe


def test_reference_latents_match_diffusers(diffusers_pipe):
    image = torch.rand(1, 3, H, W, generator=torch.Generator().manual_seed(1)) * 2 - 1
    want = WanAnimatePipeline.prepare_reference_image_latents(diffusers_pipe, image, 1, device="cpu")
    got = reference_latents(diffusers_pipe.vae, image)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["animate", "replace"])
@pytest.mark.parametrize("start", [0, 8])
@pytest.mark.parametrize("overlap", [1, 5])
def test_segment_latents_match_diffusers(diffusers_pipe, mode, start, overlap):
    plan = plan_segments(20, 13, overlap)
    g = torch.Generator().manual_seed(2)
    previous = torch.rand(1, 3, overlap, H, W, generator=g) * 2 - 1 if start > 0 else None
    background = torch.rand(1, 3, 13, H, W, generator=g) * 2 - 1 if mode == "replace" else None
    mask = (torch.rand(1, 1, 13, H, W, generator=g) > 0.5).float() if mode == "replace" else None
    want = WanAnimatePipeline.prepare_prev_segment_cond_latents(
        diffusers_pipe, previous, background_video=background, mask_video=mask, batch_size=1,
        segment_frame_length=13, start_frame=start, height=H, width=W, prev_segment_cond_frames=overlap, task=mode,
        device="cpu")
    got = segment_latents(diffusers_pipe.vae, plan, start, (H, W), previous, background, mask)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
