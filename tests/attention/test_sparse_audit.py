"""Sparse backends at grid shapes their tiles and windows do not divide, batch 2 and one head, against dense
attention with a token mask built in float64 from each documented rule (the references of
``test_sparse_backends``: raster-order coordinates, never the backends' layouts); STA's per-head windows on a
call that holds only some of the layer's heads (sequence parallelism); strategy checks against a DiT's shape."""
import pytest
import torch

from fastwan.attention.base import AttentionMetadata
from fastwan.attention.registry import create_backend
from fastwan.errors import InvalidArgument
from tests.attention.test_sparse_backends import (close, na_ref_mask, qkv, ref_attention, run, sta_ref_mask,
                                                  vsa_reference)

GRIDS = [(3, 5, 7), (1, 4, 6), (2, 1, 1), (1, 1, 1)]  # odd sizes, a single frame, fewer tokens than one tile


def clamp(tile, grid):
    return tuple(min(t, g) for t, g in zip(tile, grid))


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("tile,window", [((2, 3, 4), (3, 1, 5)), ((4, 4, 4), (9, 9, 9))])
def test_sta_at_odd_grids(grid, tile, window):
    q, k, v = qkv(grid, heads=1, dim=8, batch=2)
    b = create_backend("SLIDING_TILE_ATTN", {"tile": list(tile), "window": list(window), "kernel": "sdpa"})
    close(run(b, grid, q, k, v), ref_attention(q, k, v, sta_ref_mask(grid, clamp(tile, grid), window)))


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("conf", [dict(kernel_size=[1, 1, 1]), dict(kernel_size=[-1, 1, 1], is_causal=True),
                                  dict(tile=[2, 3, 4]), dict(stride=[1, 1, 1], is_causal=[True, False, False])])
def test_na_at_odd_grids(grid, conf):
    q, k, v = qkv(grid, heads=1, dim=8, batch=2)
    b = create_backend("NEIGHBORHOOD_ATTN", {**conf, "kernel": "sdpa"})
    spec = b.spec(grid)  # the default kernel size fitted to the grid, or the explicit one (-1: whole axis)
    want = ref_attention(q, k, v, na_ref_mask(grid, spec.kernel_size, spec.stride, spec.dilation, spec.is_causal))
    close(run(b, grid, q, k, v), want)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("tile,sparsity", [((4, 4, 4), 0.0), ((1, 2, 2), 0.5), ((2, 3, 4), 0.999)])
def test_vsa_at_odd_grids(grid, tile, sparsity):
    q, k, v = qkv(grid, heads=1, dim=8, batch=2)
    gate = torch.randn_like(q)
    b = create_backend("VIDEO_SPARSE_ATTN", {"tile": list(tile), "sparsity": sparsity, "kernel": "sdpa"})
    close(run(b, grid, q, k, v, gate=gate), vsa_reference(q, k, v, grid, clamp(tile, grid), sparsity, gate))


PER_HEAD = [  # four heads, each its own window; the flat form leaves heads 0 and 2 at "window"
    ({"*": {"*": [[1, 1, 1], [3, 3, 3], [1, 3, 1], [3, 1, 3]]}}, [(1, 1, 1), (3, 3, 3), (1, 3, 1), (3, 1, 3)]),
    ({"0_0_1": [3, 3, 3], "0_0_3": [1, 3, 1]}, [(1, 1, 1), (3, 3, 3), (1, 1, 1), (1, 3, 1)]),
]


@pytest.mark.parametrize("strategy,windows", PER_HEAD)
def test_sta_per_head_windows_on_a_slice_of_the_heads(strategy, windows):
    """A call that holds heads first .. first + H - 1 of the layer (meta.extra["head_range"], as Ulysses sequence
    parallelism splits them) applies those heads' windows; without it, the call's heads are the layer's."""
    grid, tile = (3, 5, 7), (1, 2, 2)
    b = create_backend("SLIDING_TILE_ATTN", {"tile": list(tile), "window": 1, "strategy": strategy, "kernel": "sdpa"})
    q, k, v = qkv(grid, heads=4, dim=8, batch=2)
    want = torch.cat([ref_attention(q[:, :, h:h + 1], k[:, :, h:h + 1], v[:, :, h:h + 1],
                                    sta_ref_mask(grid, tile, windows[h])) for h in range(4)], dim=2)
    layout = b.layout(grid, "cpu")
    for first, n in [(0, 4), (0, 2), (2, 2), (1, 1), (3, 1)]:
        qp, kp, vp = (layout.permute(t[:, :, first:first + n], dim=1) for t in (q, k, v))
        extra = {} if n == 4 else {"head_range": (first, 4)}
        meta = AttentionMetadata(grid=grid, step_index=0, layer_index=0, layout=layout, extra=extra)
        close(layout.unpermute(b(qp, kp, vp, meta=meta), dim=1), want[:, :, first:first + n])


def test_sta_head_range_that_does_not_hold_the_call_is_refused():
    b = create_backend("SLIDING_TILE_ATTN", {"tile": [1, 2, 2], "strategy": {"*": {"*": [[1, 1, 1]] * 4}}})
    layout = b.layout((2, 4, 4), "cpu")
    q = torch.zeros(1, layout.padded_tokens, 2, 8)
    meta = AttentionMetadata(grid=(2, 4, 4), layout=layout, extra={"head_range": (3, 4)})
    with pytest.raises(ValueError, match=r"head_range.*\(3, 4\).*2 heads"):
        b(q, q, q, meta=meta)


CHECK_MODEL = [  # strategy, (heads, layers) that fit, (heads, layers) that do not, message
    ({"5": {"*": [[1, 1, 1]] * 4}}, (4, 2), (3, 2), r"strategy\['5'\]\['\*'\] lists 4 per-head windows.*3 heads"),
    ({"0_1_3": [1, 1, 1]}, (4, 2), (3, 2), r"'0_1_3' names head 3 but the layer has 3 heads"),
    ({"0_1_3": [1, 1, 1]}, (4, 2), (4, 1), r"'0_1_\.\.\.' names layer 1 but the DiT has 1 layers"),
    ({"*": {"7": 3}}, (1, 8), (1, 7), r"strategy \['\*'\]\['7'\] names layer 7 but the DiT has 7 layers"),
]


@pytest.mark.parametrize("strategy,fits,misfits,msg", CHECK_MODEL)
def test_sta_strategy_is_checked_against_the_dit_before_any_call(strategy, fits, misfits, msg):
    """Every entry at once, whatever step it is for (a step-5 entry would otherwise fail at step 5)."""
    b = create_backend("SLIDING_TILE_ATTN", {"strategy": strategy})
    b.check_model(*fits)
    with pytest.raises(InvalidArgument, match=msg):
        b.check_model(*misfits)
    for other in ("NEIGHBORHOOD_ATTN", "VIDEO_SPARSE_ATTN"):
        create_backend(other, {}).check_model(*misfits)  # nothing per head or layer to check


@pytest.mark.parametrize("strategy,msg", [
    ({"00_1_2": 3, "0_1_2": 5}, r"strategy\['0_1_2'\] names the same entry.*'0_1_2'"),
    ({"0": {"1": 3}, "00": {"1": 5}}, r"strategy\['00'\]\['1'\] names the same entry.*\['0'\]\['1'\]"),
    ({"*": {"1": 3, "01": 5}}, r"strategy\['\*'\]\['01'\] names the same entry"),
])
def test_sta_strategy_keys_naming_one_entry_twice_raise(strategy, msg):
    with pytest.raises(InvalidArgument, match=msg):
        create_backend("SLIDING_TILE_ATTN", {"strategy": strategy})


def test_from_pretrained_checks_the_strategy_against_the_dit_before_weights_load(tmp_path, monkeypatch):
    """Five per-head windows for a DiT with fewer heads: refused by from_pretrained, before any weight loads."""
    import fastwan.pipelines.generator as generator
    from fastwan.checkpoint.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "wan2.1", "wan2.1", seed=0)

    def loaded(*a, **k):
        raise AssertionError("weights loaded before the attention config was checked against the DiT")

    monkeypatch.setattr(generator, "load_transformer", loaded)
    conf = {"tile": [1, 2, 2], "strategy": {"*": {"*": [[1, 1, 1]] * 5}}}
    with pytest.raises(InvalidArgument, match="5 per-head windows"):
        generator.VideoGenerator.from_pretrained(ckpt, device="cpu", dtype=torch.float32,
                                                 attention_backend="SLIDING_TILE_ATTN", attention_config=conf)
