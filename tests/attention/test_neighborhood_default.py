"""NEIGHBORHOOD_ATTN's default kernel fits any grid; an explicit kernel_size must fit and raises otherwise.

Rule under test: with ``kernel_size`` unset, each entry of the default (7, 15, 15) is clamped to
``grid size // dilation``; the result must equal dense attention under NATTEN's window of the clamped kernel
(reference: the scalar NATTEN windows and fp64 masked attention of test_sparse_backends, written from the
definition) and the backend given that clamped kernel explicitly.
"""
import pytest
import torch

from fastwan.attention import AttentionDispatch, create_backend
from fastwan.models import load_transformer
from tests.attention.test_sparse_backends import close, na_ref_mask, qkv, ref_attention, run

DEFAULT = (7, 15, 15)
# T and H below the default (a 9-frame video has 3 latent frames), W above it (stays 15)
SMALL_GRID = (3, 5, 17)

CASES = [
    {},
    {"dilation": [1, 2, 1]},  # H: 5 // 2 = 2
    {"stride": [1, 2, 3], "is_causal": [True, False, False]},
]


def clamped(grid, dilation):
    """The rule, written out: min(default, size // dilation) per dimension."""
    return [min(k, g // d) for k, g, d in zip(DEFAULT, grid, dilation)]


@pytest.mark.parametrize("case", CASES)
def test_default_kernel_fits_a_small_grid(case):
    full = {"stride": [1] * 3, "dilation": [1] * 3, "is_causal": [False] * 3, **case}
    ks = clamped(SMALL_GRID, full["dilation"])
    default = create_backend("NEIGHBORHOOD_ATTN", {"tile": [2, 3, 4], **case})
    explicit = create_backend("NEIGHBORHOOD_ATTN", {"tile": [2, 3, 4], "kernel_size": ks, **case})
    q, k, v = qkv(SMALL_GRID, batch=1)
    got = run(default, SMALL_GRID, q, k, v)
    close(got, ref_attention(q, k, v, na_ref_mask(SMALL_GRID, ks, full["stride"], full["dilation"],
                                                  full["is_causal"])))
    assert torch.equal(got, run(explicit, SMALL_GRID, q, k, v))
    assert torch.equal(default.dense_mask(SMALL_GRID), explicit.dense_mask(SMALL_GRID))


def test_default_kernel_is_clamped_per_dimension():
    """Large grids keep the default; a 9-frame 768x1280 Wan2.1 video (DiT grid 3 x 48 x 80) clamps only T."""
    default = create_backend("NEIGHBORHOOD_ATTN", {})
    explicit = create_backend("NEIGHBORHOOD_ATTN", {"kernel_size": list(DEFAULT)})
    for grid, want in (((8, 16, 16), DEFAULT), ((21, 30, 52), DEFAULT), ((3, 48, 80), (3, 15, 15)),
                       (SMALL_GRID, (3, 5, 15)), ((1, 1, 1), (1, 1, 1))):
        assert default.spec(grid).kernel_size == want, grid
    assert torch.equal(default.dense_mask((8, 16, 16)), explicit.dense_mask((8, 16, 16)))


def test_explicit_kernel_larger_than_the_grid_raises():
    for kernel_size, match in (
        ([7, 15, 15], r"kernel_size\[0\] \* dilation\[0\] = 7 \* 1 = 7 exceeds the grid size 3 along T.*"
                      r"kernel_size\[0\] <= 3.*leave kernel_size unset"),
        ([3, 7, 15], r"kernel_size\[1\] \* dilation\[1\] = 7 \* 1 = 7 exceeds the grid size 5 along H"),
    ):
        b = create_backend("NEIGHBORHOOD_ATTN", {"kernel_size": kernel_size, "is_causal": [False, True, False]})
        with pytest.raises(ValueError, match=match):
            b.layout(SMALL_GRID, "cpu")


def test_default_kernel_errors_name_the_rule_and_fix():
    b = create_backend("NEIGHBORHOOD_ATTN", {"dilation": [4, 1, 1]})
    with pytest.raises(ValueError, match=r"dilation\[0\] = 4 exceeds the grid size 3 along T.*dilation\[0\] <= 3"):
        b.layout(SMALL_GRID, "cpu")
    b = create_backend("NEIGHBORHOOD_ATTN", {"stride": [5, 1, 1]})
    with pytest.raises(ValueError, match=r"stride\[0\] = 5 > kernel_size\[0\] = 3 \(the default kernel_size "
                                         r"fitted to the grid\).*stride\[0\] <= 3"):
        b.layout(SMALL_GRID, "cpu")


def test_default_neighborhood_in_the_dit_on_a_few_frames(tiny_ckpts):
    """A few-frame video's DiT grid (3 x 3 x 5 here) is smaller than the default kernel in every dimension:
    the default then spans the whole grid, so the DiT equals its dense-attention self."""
    folder = tiny_ckpts["wan2.1"] / "transformer"
    dense = AttentionDispatch.resolve("TORCH_SDPA", device="cpu", dtype=torch.float32, head_dim=12)
    model = load_transformer(folder, dtype=torch.float32, device="cpu", attention=dense)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, model.config.in_channels, 3, 6, 10, generator=g)
    text = torch.randn(1, 7, model.config.text_dim, generator=g)
    t = torch.tensor([700.0])
    with torch.no_grad():
        want = model(x, t, text)
        model.set_attention(AttentionDispatch(create_backend("NEIGHBORHOOD_ATTN"), create_backend("TORCH_SDPA")))
        got = model(x, t, text)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
