"""fastwan's Wan2.2-Animate DiT (pose embedding, motion and face encoders, face adapters:
:mod:`fastwan.models.wan.animate`) against diffusers' WanAnimateTransformer3DModel on the same weights (fp32): the
forward at batch 1 and 2, both CFG forms with the unconditional pass's blank face, both block builds."""
from __future__ import annotations

import pytest
import torch
from diffusers import WanAnimateTransformer3DModel

from fastwan.attention import AttentionDispatch
from fastwan.hooks import HookRegistry
from fastwan.models import load_transformer
from fastwan.models.wan.animate import animate_inputs
from fastwan.options import DiTOptions

FRAMES = 4  # latent frames: the reference's and 3 of the segment (9 .. 12 face frames)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(batch=1, face_frames=12, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 36, FRAMES, 6, 8, generator=g)  # 4 x 3 x 4 tokens
    pose = torch.randn(batch, 16, FRAMES - 1, 6, 8, generator=g)
    face = torch.rand(batch, 3, face_frames, 16, 16, generator=g) * 2 - 1
    texts = [torch.randn(batch, 512, 32, generator=g) for _ in range(2)]  # diffusers reads 512 text tokens
    image = torch.randn(batch, 5, 24, generator=g)
    return x, pose, face, texts, image


def load(folder, block):
    attn = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    return load_transformer(folder, dtype=torch.float32, device="cpu", attention=attn,
                            options=DiTOptions(block=block))


@pytest.mark.parametrize("block", ["reference", "fast"])
@pytest.mark.parametrize("batch,face_frames", [(1, 12), (2, 9)])
def test_animate_dit_matches_diffusers(animate_dit, block, batch, face_frames):
    ref = WanAnimateTransformer3DModel.from_pretrained(animate_dit, dtype=torch.float32).eval()
    ours = load(animate_dit, block)
    assert len(ours.face_adapter) == 2
    x, pose, face, (text, _), image = inputs(batch, face_frames)
    t = torch.tensor([700.0] * batch)
    with torch.no_grad():
        want = ref(x, t, text, image, pose, face, return_dict=False)[0]
        with animate_inputs(ours, pose, face, motion_batch_size=4):
            got = ours(x, t, text, image=image)
        # the face and pose inputs matter: a run on other ones differs
        with animate_inputs(ours, pose, torch.flip(face, [2])):
            other_face = ours(x, t, text, image=image)
        with animate_inputs(ours, pose * 0, face):
            no_pose = ours(x, t, text, image=image)
    assert HookRegistry.of(ours).names() == []  # the hook leaves with its block
    assert rel_err(got, want) < 1e-4
    assert rel_err(other_face, want) > 1e-3 and rel_err(no_pose, want) > 1e-3


@pytest.mark.parametrize("block", ["reference", "fast"])
def test_animate_forward_cfg_matches_diffusers(animate_dit, block):
    """forward_cfg's passes are diffusers' conditional pass (the face video, the text) and unconditional one (the
    face blanked to -1, as diffusers' pipeline does, and the negative text), batched or one after the other."""
    ref = WanAnimateTransformer3DModel.from_pretrained(animate_dit, dtype=torch.float32).eval()
    ours = load(animate_dit, block)
    x, pose, face, (text, text_u), image = inputs()
    blank = face * 0 - 1
    t = torch.tensor([400.0])
    with torch.no_grad():
        want = [ref(x, t, txt, image, pose, f, return_dict=False)[0] for txt, f in ((text, face), (text_u, blank))]
        with animate_inputs(ours, pose, face, face_uncond=blank):
            pairs = [ours.forward_cfg(x, t, text, text_u, image=image, batched=b) for b in (True, False)]
    for pair in pairs:
        assert rel_err(pair[0], want[0]) < 1e-4 and rel_err(pair[1], want[1]) < 1e-4
