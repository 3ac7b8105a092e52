"""The face tokens' step-free work is done once: the motion directions (a QR) once per face video however many
batches of frames the motion encoder runs, the blur kernels once per device and dtype (made per call on a GPU,
their host-to-device copy synchronises the stream every call); the tokens equal a per-batch reference bit for
bit."""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from fastwan.models import WanConfig
from fastwan.models.wan.animate import BLUR, face_tokens
from fastwan.models.wan.transformer import WanTransformer
from tests.animate.conftest import TINY_ANIMATE


def tiny_model():
    model = WanTransformer(WanConfig.from_dict({"_class_name": "WanAnimateTransformer3DModel", **TINY_ANIMATE}))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model.eval()


def op_counts(fn) -> dict[str, int]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for ev in prof.events():
        counts[ev.name] = counts.get(ev.name, 0) + 1
    return counts


def reference_tokens(model, face, step):
    """Face tokens as diffusers makes them: every batch of frames through the whole motion encoder (its own QR)
    with the blur kernels made per call."""
    me = model.motion_encoder
    k = torch.tensor(BLUR, dtype=face.dtype)
    blur = torch.outer(k, k) / k.sum() ** 2

    def conv(c, x):
        if c.blur_padding is not None:
            x = torch.nn.functional.conv2d(x, blur[None, None].expand(c.cin, 1, -1, -1), padding=c.blur_padding,
                                           groups=c.cin)
        x = torch.nn.functional.conv2d(x, c.weight * c.scale, c.bias, c.stride, c.padding)
        return x if c.act_fn is None else c.act_fn(x, 1)

    B, _, S = face.shape[:3]
    out = []
    for f in face.transpose(1, 2).flatten(0, 1).split(step):
        x = conv(me.conv_in, f)
        for blk in me.res_blocks:
            x = (conv(blk.conv2, conv(blk.conv1, x)) + conv(blk.conv_skip, x)) / 2 ** 0.5
        alpha = conv(me.conv_out, x).flatten(1)
        for lin in me.motion_network:
            alpha = lin(alpha)
        q = torch.linalg.qr((me.motion_synthesis_weight + 1e-8).float())[0]
        out.append((alpha.float() @ q.T).to(alpha.dtype))
    tokens = model.face_encoder(torch.cat(out).unflatten(0, (B, S)))
    return torch.cat([torch.zeros_like(tokens[:, :1]), tokens], dim=1)


@torch.no_grad()
def test_face_tokens_make_directions_once_and_match_per_batch_reference():
    model = tiny_model()
    face = torch.rand(1, 3, 12, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    got = face_tokens(model, face, batch_size=5)  # 3 batches of frames
    assert torch.equal(got, reference_tokens(model, face, 5))
    counts = op_counts(lambda: face_tokens(model, face, batch_size=5))
    assert counts.get("aten::linalg_qr", 0) == 1, counts.get("aten::linalg_qr")


@torch.no_grad()
def test_blur_kernels_made_once_per_device_and_dtype():
    model = tiny_model()
    face = torch.rand(1, 3, 9, 16, 16, generator=torch.Generator().manual_seed(2)) * 2 - 1
    first = face_tokens(model, face, batch_size=4)
    counts = op_counts(lambda: face_tokens(model, face, batch_size=4))
    assert counts.get("aten::outer", 0) == 0, "a blur kernel was made again on the same device and dtype"
    assert torch.equal(face_tokens(model, face, batch_size=4), first)
    # another dtype: its own kernels, of that dtype's values
    model64 = model.double()
    got = face_tokens(model64, face.double(), batch_size=4)
    assert got.dtype == torch.float64
    assert torch.equal(got, reference_tokens(model64, face.double(), 4))
