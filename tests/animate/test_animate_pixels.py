"""The pixels Wan2.2-Animate's pipeline encodes, against diffusers' own processors as WanAnimatePipeline builds
them: the reference image (WanAnimateImageProcessor, resize_mode "fill", fill 0), the driving videos
(VideoProcessor), the mask (VideoProcessor, grey, not normalised) and its latent form (1 - mask, nearest)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers.pipelines.wan.image_processor import WanAnimateImageProcessor
from diffusers.video_processor import VideoProcessor
from PIL import Image

from fastwan.pipelines.animate import driving_pixels, latent_mask, mask_pixels, reference_pixels


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("size", [(40, 24), (24, 40), (32, 48), (17, 53)])
def test_reference_image_is_fitted_as_diffusers_fits_it(size):
    image = _image(*size, seed=1)
    ref = WanAnimateImageProcessor(vae_scale_factor=8, spatial_patch_size=(2, 2), resample="bilinear", fill_color=0)
    want = ref.preprocess(image, height=32, width=48, resize_mode="fill")
    got = reference_pixels(image, 32, 48)
    assert got.shape == want.shape == (1, 3, 32, 48)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_driving_frames_are_resized_as_diffusers_resizes_them():
    frames = [_image(20, 30, seed=s) for s in range(5)]
    want = VideoProcessor(vae_scale_factor=8).preprocess_video(frames, height=32, width=48)
    got = driving_pixels(frames, 32, 48)
    assert got.shape == want.shape == (1, 3, 5, 32, 48)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_mask_is_grey_in_zero_one_and_its_latent_form_matches_diffusers():
    frames = [_image(20, 30, seed=s) for s in range(5)]
    processor = VideoProcessor(vae_scale_factor=8, do_normalize=False, do_convert_grayscale=True)
    want = processor.preprocess_video(frames, height=32, width=48)
    got = mask_pixels(frames, 32, 48)
    assert got.shape == want.shape == (1, 1, 5, 32, 48)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # diffusers' prepare_prev_segment_cond_latents: 1 - mask, frames flattened, nearest to the latent size
    flat = (1 - want).permute(0, 2, 1, 3, 4).flatten(0, 1)
    lat = F.interpolate(flat, size=(4, 6), mode="nearest").unflatten(0, (1, -1)).permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(latent_mask(got, 4, 6), lat, atol=1e-6, rtol=0)
