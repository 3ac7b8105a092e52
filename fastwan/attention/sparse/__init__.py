"""Sparse video attention backends on a 3D tile-major token layout.

* ``SLIDING_TILE_ATTN`` -> :class:`~fastwan.attention.sparse.sta.SlidingTileBackend`
* ``NEIGHBORHOOD_ATTN`` -> :class:`~fastwan.attention.sparse.neighborhood.NeighborhoodBackend`
* ``VIDEO_SPARSE_ATTN`` -> :class:`~fastwan.attention.sparse.vsa.VideoSparseBackend`

A backend takes q, k, v in its layout's slots::

    layout = backend.layout((T, H, W), device)
    q, k, v = (layout.permute(t, dim=1) for t in (q, k, v))   # raster order -> slots, dummy slots zero
    out = layout.unpermute(backend(q, k, v, meta=AttentionMetadata(grid=(T, H, W), layout=layout, ...)), dim=1)

The DiT permutes its stream once per forward into the compact order (``layout.permute_compact``: the slots
without the dummy ones; also RoPE cos/sin and per-token embeddings) and calls the backend through
:class:`~fastwan.attention.AttentionDispatch` with ``AttentionMetadata(..., compact=True)``, which pads q, k, v
to the slots and drops the output's dummy rows.

Configs are plain dicts of constructor kwargs; :func:`load_attention_config` reads them from JSON.
"""
from fastwan.attention.sparse.layout import TokenLayout, choose_tile
from fastwan.attention.sparse.config import load_attention_config

__all__ = ["TokenLayout", "choose_tile", "load_attention_config"]
