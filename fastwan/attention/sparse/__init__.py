"""Sparse video attention backends on a 3D tile-major token layout.

* ``SLIDING_TILE_ATTN`` -> :class:`~fastwan.attention.sparse.sta.SlidingTileBackend`
* ``NEIGHBORHOOD_ATTN`` -> :class:`~fastwan.attention.sparse.neighborhood.NeighborhoodBackend`
* ``VIDEO_SPARSE_ATTN`` -> :class:`~fastwan.attention.sparse.vsa.VideoSparseBackend`

Use from the DiT (once per forward)::

    layout = backend.layout((T, H, W), device)
    x = layout.permute(x, dim=1)            # also RoPE cos/sin and per-token embeddings
    ... backend(q, k, v, meta=AttentionMetadata(grid=(T, H, W), layout=layout, step_index=i, ...))
    x = layout.unpermute(x, dim=1)

Configs are plain dicts of constructor kwargs; :func:`load_attention_config` reads them from JSON.
"""
from fastwan.attention.sparse.layout import TokenLayout, choose_tile
from fastwan.attention.sparse.config import load_attention_config

__all__ = ["TokenLayout", "choose_tile", "load_attention_config"]
