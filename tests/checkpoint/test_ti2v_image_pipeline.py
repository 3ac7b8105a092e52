"""A Wan2.2-TI2V-5B checkpoint saved by diffusers' ``WanImageToVideoPipeline`` (model_index.json ``_class_name``
"WanImageToVideoPipeline", ``expand_timesteps: true``, a 48-channel DiT that reads and predicts the same channels,
no image encoder) loads and runs image-to-video as diffusers' pipeline does: the image's latents become the first
latent frame. Against diffusers on a tiny checkpoint of that layout: fp32, CPU, uint8 frames within 1 and the
decoded latents within 1e-5."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.checkpoint.presets import PRESETS, WAN_NEGATIVE_PROMPT
from fastwan.checkpoint.resolver import resolve
from fastwan.checkpoint.tiny import write_tiny_checkpoint
from fastwan.errors import InvalidArgument
from tests.pipelines.latents import generate_with_latents
from tests.image.test_image_shapes_parity import diffusers_video, picture


def write_ti2v_image_pipeline(path):
    """The tiny TI2V checkpoint with the model_index.json diffusers' WanImageToVideoPipeline.save_pretrained writes
    for it (no image encoder, no image processor)."""
    write_tiny_checkpoint(path, "wan2.2-ti2v")
    index = json.loads((path / "model_index.json").read_text())
    index.update({"_class_name": "WanImageToVideoPipeline", "image_encoder": [None, None],
                  "image_processor": [None, None]})
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return path


@pytest.fixture(scope="module")
def ti2v_i2v(tmp_path_factory):
    return write_ti2v_image_pipeline(tmp_path_factory.mktemp("ti2v-i2v") / "ckpt")


def test_loads_as_ti2v_image_to_video(ti2v_i2v):
    ckpt = resolve(ti2v_i2v)
    assert ckpt.expand_timesteps and ckpt.needs_image and not ckpt.image_encoder
    assert ckpt.transformer_config.in_channels == ckpt.transformer_config.out_channels == 48


def test_frames_match_diffusers_image_to_video_pipeline(ti2v_i2v):
    from diffusers import WanImageToVideoPipeline
    from diffusers.utils import load_image

    pipe = WanImageToVideoPipeline.from_pretrained(ti2v_i2v, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.config.expand_timesteps and pipe.image_encoder is None
    gen = VideoGenerator.from_pretrained(ti2v_i2v, device="cpu", dtype=torch.float32)
    image = picture(60, 90)
    kw = dict(height=64, width=96, num_frames=5, num_inference_steps=2)
    res, latents = generate_with_latents(gen, "a fox in the snow", image=image, seed=4, save_video=False, **kw)
    want, want_z = diffusers_video(pipe, load_image(image), prompt="a fox in the snow",
                                   negative_prompt=WAN_NEGATIVE_PROMPT, guidance_scale=res.settings["guidance_scale"],
                                   generator=torch.Generator("cpu").manual_seed(4), **kw)
    assert res.frames.shape == want.shape == (5, 64, 96, 3)
    assert want.std() > 5  # a picture, not a constant
    assert np.abs(res.frames.astype(int) - want.astype(int)).max() <= 1
    assert float((latents - want_z).abs().max()) <= 1e-5


def test_needs_an_image(ti2v_i2v):
    gen = VideoGenerator.from_pretrained(ti2v_i2v, device="cpu", dtype=torch.float32)
    with pytest.raises(InvalidArgument, match="image="):
        gen.generate_video("a fox in the snow", num_frames=5, num_inference_steps=1, save_video=False)


def test_refused_when_the_dit_reads_other_channels(tmp_path):
    """An expand_timesteps image-to-video DiT reads only the noisy latents: in_channels equal to out_channels."""
    from fastwan.errors import CheckpointError

    path = write_ti2v_image_pipeline(tmp_path / "ckpt")
    cfg_path = path / "transformer" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    (cfg_path).write_text(json.dumps({**cfg, "in_channels": 2 * cfg["out_channels"] + 4}))
    with pytest.raises(CheckpointError, match="expand_timesteps"):
        resolve(path)


def test_preset_is_ti2v(ti2v_i2v):
    assert PRESETS["wan2.2-ti2v"].num_frames == 121  # the published TI2V-5B preset the real checkpoint gets
    assert resolve(ti2v_i2v).variant == "wan2.2-ti2v"
