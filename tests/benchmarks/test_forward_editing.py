"""benchmarks.forward_14b's VACE and Animate jobs (benchmarks.editing_inputs): the DiTs at the published shapes, the
inputs of an Animate segment, and a --smoke run whose fastwan output matches diffusers' on the same weights."""
import json
import math

import pytest
import torch

from benchmarks import editing_inputs as ei
from benchmarks import forward_14b
from fastwan.models.wan.animate import face_frames


def test_the_14b_dits_have_the_published_shapes():
    vace = ei.fastwan_config("14b", "vace")
    assert vace.vace_layers == (0, 5, 10, 15, 20, 25, 30, 35) and vace.vace_in_channels == 96
    assert (vace.num_layers, vace.inner_dim, vace.in_channels) == (40, 5120, 16)
    animate = ei.fastwan_config("14b", "animate")
    # Wan2.2-Animate-14B-Diffusers' transformer/config.json
    assert (animate.in_channels, animate.latent_channels, animate.image_dim) == (36, 16, 1280)
    assert (animate.added_kv_proj_dim, animate.motion_encoder_size, animate.inject_face_latents_blocks) == \
        (5120, 512, 5)
    assert (animate.num_layers, animate.inner_dim) == (40, 5120)


def test_an_animate_segment_of_77_frames_is_21_latent_frames():
    """A 77-frame segment: 20 latent frames and the reference's; the pose latents one fewer; the face video's 77
    frames give 21 token frames (two stride-2 convolutions, then the zero frame)."""
    ref = ei.peer_class("animate")(**ei.peer_kwargs("tiny", "animate"))
    (x, _, _), cond = ei.job_inputs("animate", ref.config, 1, 720, 1280, 77, 20, "cpu", torch.float32)
    assert list(x.shape) == [1, 36, 21, 90, 160]
    assert cond.shapes["pose"] == [1, 16, 20, 90, 160] and cond.shapes["face"] == [1, 3, 77, 16, 16]
    assert math.ceil(math.ceil(77 / 2) / 2) + 1 == face_frames(77) == x.shape[2]
    assert ei.default_video("animate") == "720x1280x77" and ei.default_video("vace") == "480x832x81"


@pytest.mark.parametrize("task,dit,inputs", [
    ("vace", "WanVACETransformer3DModel", {"control": [1, 96, 2, 4, 4], "vace_layers": [0, 1]}),
    ("animate", "WanAnimateTransformer3DModel", {"image": [2, 257, 1280], "pose": [2, 16, 2, 4, 4],
                                                 "face": [2, 3, 5, 16, 16], "face_adapters": 2}),
])
def test_smoke_matches_diffusers(task, dit, inputs, tmp_path):
    out = tmp_path / "r.json"
    assert forward_14b.main(["--smoke", "--task", task, "--batch", str(2 if task == "animate" else 1),
                             "--variants", "auto,fast", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["dit"] == dit and res["inputs"] == inputs
    assert res["tokens"] == (3 if task == "animate" else 2) * 2 * 2
    for label in ("auto", "fast"):
        assert res["fastwan"][label]["rel_err_vs_diffusers"] < 1e-5  # fp32 on the CPU
