"""What composes with the Animate DiT: compiled blocks give the eager DiT's output (the face adapters run between
compiled blocks); sparse backends' compact token order carries the pose tokens and the face adapters' per-frame
attention as the dense order does."""
from __future__ import annotations

import torch

from fastwan.attention import AttentionDispatch, create_backend
from fastwan.models.wan.animate import animate_inputs
from tests.animate.test_animate_dit import inputs, load, rel_err


def test_compiled_blocks_match_eager(animate_dit):
    torch._dynamo.reset()
    model = load(animate_dit, "reference")
    x, pose, face, (text, text_u), image = inputs()
    t = torch.tensor([600.0])
    with torch.no_grad(), animate_inputs(model, pose, face, face_uncond=face * 0 - 1):
        want = model(x, t, text, image=image), *model.forward_cfg(x, t, text, text_u, image=image)
        model.compile_blocks(fullgraph=True, backend="aot_eager")  # fullgraph: any graph break raises
        got = model(x, t, text, image=image), *model.forward_cfg(x, t, text, text_u, image=image)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_sparse_backends_keep_the_pose_and_face_in_place(animate_dit):
    """Dense-equivalent configs of the sparse backends (their compact token order, the attention over all tokens)
    give the dense Animate DiT's output: the pose tokens are permuted as the stream is, and each face adapter reads
    the stream in frame order."""
    model = load(animate_dit, "reference")
    x, pose, face, (text, _), image = inputs()
    t = torch.tensor([800.0])
    kw = dict(step_index=3, num_steps=10)
    with torch.no_grad(), animate_inputs(model, pose, face):
        want = model(x, t, text, image=image, **kw)
        for name, conf in [("SLIDING_TILE_ATTN", {"tile": [2, 3, 2], "window": 99}),
                           ("NEIGHBORHOOD_ATTN", {"tile": [2, 3, 2], "kernel_size": -1})]:
            model.set_attention(AttentionDispatch(create_backend(name, conf), create_backend("TORCH_SDPA")))
            got = model(x, t, text, image=image, **kw)
            assert rel_err(got, want) <= 1e-5, name
