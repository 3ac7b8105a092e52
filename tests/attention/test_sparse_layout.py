"""TokenLayout: exact round trips, the tile-major order checked against a brute-force enumeration."""
import itertools
import math
import random

import pytest
import torch

from fastwan.attention.sparse.layout import TokenLayout, choose_tile


def brute_force_order(grid, tile, block_size):
    """List of slots: the raster index of each slot or None for a dummy, by explicit enumeration."""
    T, H, W = grid
    n = [math.ceil(g / t) for g, t in zip(grid, tile)]
    slots = []
    for a, b, c in itertools.product(range(n[0]), range(n[1]), range(n[2])):
        tile_slots = []
        for i, j, k in itertools.product(range(tile[0]), range(tile[1]), range(tile[2])):
            t, h, w = a * tile[0] + i, b * tile[1] + j, c * tile[2] + k
            tile_slots.append((t * H + h) * W + w if (t < T and h < H and w < W) else None)
        tile_slots += [None] * (block_size - len(tile_slots))
        slots += tile_slots
    return slots


@pytest.mark.parametrize(
    "grid,tile,block",
    [((5, 7, 9), (2, 3, 4), None), ((5, 7, 9), (2, 3, 4), 24), ((4, 8, 8), (2, 4, 4), 32), ((1, 6, 10), (2, 4, 4), 40),
     ((3, 5, 2), (1, 1, 1), 1), ((7, 3, 11), (4, 4, 4), 64)],
)
def test_order_matches_brute_force(grid, tile, block):
    layout = TokenLayout(grid, tile, block)
    expected = brute_force_order(grid, tile, layout.block_size)
    assert layout.padded_tokens == len(expected)
    got = layout.token_of_slot.tolist()
    assert got == [-1 if e is None else e for e in expected]
    assert layout.key_valid.tolist() == [e is not None for e in expected]
    # permute of raster indices reproduces the order; dummy slots are zero
    x = torch.arange(1, layout.num_tokens + 1, dtype=torch.float64)[None, :, None]
    y = layout.permute(x, dim=1)[0, :, 0].tolist()
    assert y == [0.0 if e is None else e + 1.0 for e in expected]
    # every tile has at least one real token; counts agree
    counts = layout.key_valid.view(layout.num_tiles, layout.block_size).sum(1)
    assert torch.equal(counts, layout.tile_valid_counts) and bool((counts >= 1).all())
    # dummy slots carry a real coordinate inside their own tile
    c = layout.coords
    assert bool((c < torch.tensor(grid)).all()) and bool((c >= 0).all())
    tile_of_coord = (c[:, 0] // tile[0] * layout.tile_grid[1] + c[:, 1] // tile[1]) * layout.tile_grid[2] \
        + c[:, 2] // tile[2]
    assert torch.equal(tile_of_coord, torch.arange(layout.padded_tokens) // layout.block_size)


def test_round_trip_many_grids():
    rng = random.Random(0)
    for _ in range(60):
        grid = (rng.randint(1, 9), rng.randint(1, 12), rng.randint(1, 12))
        tile = (rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 5))
        block = rng.choice([None, math.prod(tile), math.prod(tile) + rng.randint(1, 9)])
        layout = TokenLayout(grid, tile, block)
        x = torch.randn(2, layout.num_tokens, 3, dtype=torch.float32)
        y = layout.permute(x, dim=1)
        assert y.shape == (2, layout.padded_tokens, 3)
        assert torch.equal(layout.unpermute(y, dim=1), x)
        assert bool((y[:, ~layout.key_valid] == 0).all())
        # other dims and [1, S, 1, D] RoPE-style tables
        r = torch.randn(1, layout.num_tokens, 1, 4)
        assert torch.equal(layout.unpermute(layout.permute(r, dim=1), dim=1), r)
        z = torch.randn(layout.num_tokens, 5)
        assert torch.equal(layout.unpermute(layout.permute(z, dim=0), dim=0), z)
        assert torch.equal(layout.unpermute(layout.permute(z, dim=-2), dim=-2), z)


def test_compact_order_is_the_slots_without_the_dummies():
    """permute_compact == drop_slots(permute); pad_slots(permute_compact) == permute (dummy slots zero); each
    helper's inverse undoes it, on any dim; and with no dummy slot the compact order is the slots' order."""
    rng = random.Random(1)
    cases = [((3, 5, 7), (2, 4, 4), None), ((4, 8, 8), (2, 4, 4), None), ((5, 7, 9), (2, 3, 4), 32)]
    cases += [((rng.randint(1, 9), rng.randint(1, 12), rng.randint(1, 12)),
               (rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 5)), None) for _ in range(30)]
    for grid, tile, block in cases:
        layout = TokenLayout(grid, tile, block)
        x = torch.randn(2, layout.num_tokens, 3, dtype=torch.float64)
        c = layout.permute_compact(x, dim=1)
        assert c.shape == x.shape
        # the compact rows in order: the real slots' raster tokens, by a plain Python walk over the slots
        walk = [t for t in layout.token_of_slot.tolist() if t >= 0]
        assert torch.equal(c, x[:, walk])
        assert torch.equal(c, layout.drop_slots(layout.permute(x, dim=1), dim=1))
        assert torch.equal(layout.pad_slots(c, dim=1), layout.permute(x, dim=1))
        assert torch.equal(layout.unpermute_compact(c, dim=1), x)
        assert torch.equal(layout.drop_slots(layout.pad_slots(c, dim=1), dim=1), c)
        z = torch.randn(layout.num_tokens, 5)
        assert torch.equal(layout.unpermute_compact(layout.permute_compact(z, dim=0), dim=0), z)
        r = torch.randn(1, layout.num_tokens, 1, 4)
        assert torch.equal(layout.pad_slots(layout.permute_compact(r, dim=1), dim=1), layout.permute(r, dim=1))
        if not layout.has_dummies:
            assert layout.pad_slots(c, dim=1) is c and layout.drop_slots(c, dim=1) is c


def test_pad_slots_overwrites_every_slot():
    """pad_slots' route for a dim other than 1: every slot is written (real rows copied, dummy rows zero), whatever
    fresh memory holds (NaN here, through a new_empty that returns NaN)."""
    layout = TokenLayout((3, 5, 7), (2, 4, 4))
    x = torch.randn(layout.num_tokens, 2)

    class Poisoned(torch.Tensor):
        def new_empty(self, *a, **k):
            return torch.full(*a, float("nan"), dtype=self.dtype)

    y = layout.pad_slots(layout.permute_compact(x, dim=0).as_subclass(Poisoned), dim=0).as_subclass(torch.Tensor)
    assert torch.isfinite(y).all() and torch.equal(y, layout.permute(x, dim=0))


def test_permute_is_differentiable():
    layout = TokenLayout((3, 5, 7), (2, 4, 4))
    x = torch.randn(1, layout.num_tokens, 2, requires_grad=True)
    layout.unpermute(layout.permute(x) * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    x.grad = None
    layout.unpermute_compact(layout.drop_slots(layout.pad_slots(layout.permute_compact(x)) * 3)).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_shape_errors():
    layout = TokenLayout((3, 5, 7), (2, 4, 4))
    with pytest.raises(ValueError, match="105 tokens"):
        layout.permute(torch.zeros(1, 100, 4))
    with pytest.raises(ValueError, match="unpermute"):
        layout.unpermute(torch.zeros(1, 105, 4))
    with pytest.raises(ValueError, match="pad_slots: .*105 tokens"):
        layout.pad_slots(torch.zeros(1, layout.padded_tokens, 4))
    with pytest.raises(ValueError, match=f"drop_slots: .*{layout.padded_tokens} tokens"):
        layout.drop_slots(torch.zeros(1, 105, 4))
    with pytest.raises(ValueError, match="permute_compact"):
        layout.permute_compact(torch.zeros(1, 104, 4))
    with pytest.raises(ValueError, match="block_size"):
        TokenLayout((3, 5, 7), (2, 4, 4), block_size=16)
    with pytest.raises(ValueError, match="grid"):
        TokenLayout((3, 5), (2, 4, 4))
    with pytest.raises(ValueError, match=">= 1"):
        TokenLayout((3, 0, 5), (2, 4, 4))


def test_choose_tile():
    assert choose_tile((21, 30, 52)) == (3, 10, 4)
    assert choose_tile((21, 45, 80)) == (1, 8, 16)  # ties prefer tiles without slot padding
    for grid in [(21, 30, 52), (1, 30, 52), (2, 3, 4), (31, 60, 104), (11, 22, 40)]:
        tile = choose_tile(grid)
        assert math.prod(tile) <= 128 and all(t <= g for t, g in zip(tile, grid))
        layout = TokenLayout(grid, tile, 128)
        # no candidate of the 2x8x8 family wastes fewer slots than the choice
        assert layout.padded_tokens <= TokenLayout(grid, tuple(min(a, b) for a, b in zip((2, 8, 8), grid)),
                                                   128).padded_tokens
