"""What the fast block's cross-attention reads: per prompt and per block, keys and values computed once.

Wan pads the text to 512 tokens with zero rows, and every padding row goes through the same row-wise maps, so
all padding rows give one key and one value: the cross-attention over them equals attention over the first
``n`` keys with key ``n - 1`` counted ``L - n + 1`` times (:func:`text_keys`, the ops of
:mod:`fastwan.kernels.text_cross`). For short prompts the output projection is also folded into the values:
``P @ V @ W_o^T = P @ U`` with ``U = V W_o^T`` per head (:func:`fold_values`), so each forward runs one GEMM with
K = heads x width instead of P @ V and the [S, C] x [C, C] projection.

:class:`PromptCache` holds those tensors per tuple of text tensors (objects and versions) and the weights they
came from (storage and version), so a denoising loop computes them at its first step only. An entry lives only as
long as its text tensors: it is dropped when one of them is freed (a weakref callback), so nothing is held after a
request, e.g. during its VAE decode or between requests.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastwan.kernels.fp8 import dense_weight

MAX_KEYS = 128  # collapse up to this many keys; from ~150 keys the kernel only ties FA4 over all 512
FOLD_ALIGN = 8  # width rounds the key count up to this (P's rows stay 16-byte aligned for cuBLAS in fp16/bf16)
FOLD_MAX_WIDTH = 0.5  # fold where width <= this fraction of the head dim: the GEMM's K at most half the projection's
KEEP_PROMPTS = 4  # prompt tuples held by a PromptCache (each holds 2 x layers x L x C)


class CrossInputs(NamedTuple):
    """What the reference block's cross-attention reads: the text embedding [B, L, C] and, for image-conditioned
    checkpoints, the image tokens embedded [B, N, C] (else None)."""
    text: torch.Tensor
    image: torch.Tensor | None = None


class CrossKV(NamedTuple):
    """One block's cross-attention input for a batch of prompts: k (after ``norm_k``) and v [B, L, H, D];
    ``keys`` int32 [B] where the text padding is collapsed into one weighted key, else None. Folded (``u``
    [B, H * width, C] set, v None): the block adds P @ u plus ``to_out``'s bias instead of projecting P @ V.
    Image-conditioned: the image tokens' keys (after ``norm_added_k``) and values ``k_img``, ``v_img``
    [B, N, H, D], attended separately and added before the output projection."""
    k: torch.Tensor
    v: torch.Tensor | None
    keys: torch.Tensor | None
    u: torch.Tensor | None = None
    k_img: torch.Tensor | None = None
    v_img: torch.Tensor | None = None


def text_keys(text: torch.Tensor) -> torch.Tensor:
    """text [B, L, D] -> int32 [B]: per sample, the number of leading rows that differ from the trailing run of
    rows equal to the last row, plus one (the run's representative). L when the last row is unique (no padding);
    1 when all rows are equal."""
    if text.dim() != 3 or text.shape[1] == 0:
        raise ValueError(f"text_keys: text must be [B, L, D] with L >= 1, got {tuple(text.shape)}")
    L = text.shape[1]
    same = (text == text[:, -1:]).all(dim=-1)  # [B, L]; the last row is always True (NaN rows: never equal)
    idx = torch.arange(L, device=text.device)
    last_other = torch.where(same, -1, idx).amax(dim=-1)  # the last row that differs from the last row, or -1
    return (last_other + 2).clamp(max=L).to(torch.int32)


def fold_width(max_keys: int, head_dim: int, max_fraction: float = FOLD_MAX_WIDTH) -> int | None:
    """The width of P and U for prompts of at most ``max_keys`` keys (rounded up to FOLD_ALIGN), or None where the
    fold does not pay (width above ``max_fraction`` of the head dim)."""
    if max_keys < 1:
        raise ValueError(f"fold_width: max_keys must be >= 1, got {max_keys}")
    width = -(-max_keys // FOLD_ALIGN) * FOLD_ALIGN
    return width if width <= max_fraction * head_dim else None


def fold_values(v: torch.Tensor, keys: torch.Tensor, width: int, weight: torch.Tensor) -> torch.Tensor:
    """U for the folded output projection: v [B, L, H, D], keys int32 [B], weight [N, H * D] (``to_out``'s,
    without bias) -> [B, H * width, N] in v's dtype, U[b, h * width + j] = v[b, j, h] @ weight[:, h*D:(h+1)*D]^T
    for j < keys[b] and 0 for the rest (computed in fp32, or fp64 for fp64 inputs)."""
    B, L, H, D = v.shape
    if weight.dim() != 2 or weight.shape[1] != H * D:
        raise ValueError(f"fold_values: weight must be [N, H * D = {H * D}], got {tuple(weight.shape)}")
    if keys.shape != (B,):
        raise ValueError(f"fold_values: keys must be [{B}], got {tuple(keys.shape)}")
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    vv = v[:, :width].to(dt)
    if vv.shape[1] < width:  # a text shorter than the width: the missing keys get no weight (U rows 0)
        vv = F.pad(vv, (0, 0, 0, 0, 0, width - vv.shape[1]))
    vv = vv * (torch.arange(width, device=v.device).view(1, -1) < keys.view(-1, 1)).to(dt).view(B, width, 1, 1)
    u = torch.einsum("bjhd,nhd->bhjn", vv, weight.to(dt).view(-1, H, D))
    return u.reshape(B, H * width, -1).to(v.dtype)


class PromptCache:
    """Per-prompt cross-attention inputs of one model (:meth:`contexts`), and each text tensor's key count."""

    def __init__(self, fold_max_width: float = FOLD_MAX_WIDTH):
        self.fold_max_width = fold_max_width
        self._keys: dict[int, tuple] = {}  # id(text) -> (weakref, version, keys or None, max keys)
        self._kvs: dict[tuple, tuple] = {}  # ids of the texts -> (refs, versions, weights signature, contexts)

    def keys(self, text: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """(int32 [B] key counts, their max) for ``text`` [B, L, D]; keys None where a sample has no padding or
        more than MAX_KEYS keys (then the backend over all keys is as fast). One host sync per new text tensor."""
        hit = self._keys.get(id(text))
        if hit is not None and hit[0]() is text and hit[1] == text._version:
            return hit[2], hit[3]
        keys = text_keys(text)
        n = int(keys.max())
        keys = keys if n < text.shape[1] and n <= MAX_KEYS else None
        self._keys = {k: v for k, v in self._keys.items() if v[0]() is not None}
        self._keys[id(text)] = (weakref.ref(text), text._version, keys, n)
        return keys, n

    def contexts(self, model, texts: tuple[torch.Tensor, ...], image: torch.Tensor | None = None) -> list[CrossKV]:
        """One :class:`CrossKV` per block of ``model`` (a fast :class:`~fastwan.models.wan.WanTransformer`; its main
        blocks, then its VACE control blocks) for the texts (each [B_i, L, text_dim]) concatenated along the batch,
        and the image embeddings ``image`` (as
        :meth:`~fastwan.models.wan.WanTransformer.image_context` takes them; one sample's are shared by the whole
        batch); cached unless autograd is on."""
        found = [self.keys(t) for t in texts]
        keys = None if any(k is None for k, _ in found) else torch.cat([k for k, _ in found])
        width = None if keys is None else fold_width(max(n for _, n in found), model.config.attention_head_dim,
                                                     self.fold_max_width)
        cache = not torch.is_grad_enabled()
        inputs = texts if image is None else (*texts, image)
        ident = tuple(id(t) for t in inputs)
        sig = tuple((p.data_ptr(), p._version) for p in model.text_parameters())
        hit = self._kvs.get(ident) if cache else None
        if (hit is not None and all(r() is t for r, t in zip(hit[0], inputs))
                and hit[1] == tuple(t._version for t in inputs) and hit[2] == sig):
            return hit[3]
        context = model.text_context(texts)
        image_context = None if image is None else model.image_context(image, batch=context.shape[0])
        kvs = []
        for blk in (*model.blocks, *model.vace_blocks):  # the main blocks, then VACE's control blocks
            k, v = blk.attn2.text_kv(context)
            k_img, v_img = (None, None) if image_context is None else blk.attn2.image_kv(image_context)
            if width is None:
                kvs.append(CrossKV(k, v, keys, None, k_img, v_img))
            else:
                u = fold_values(v, keys, width, dense_weight(blk.attn2.to_out[0], v.dtype))
                torch._dynamo.maybe_mark_dynamic(u, 1)  # compiled blocks: one graph for every prompt width
                kvs.append(CrossKV(k, None, keys, u, k_img, v_img))
        if cache:
            live = {k: v for k, v in self._kvs.items() if all(r() is not None for r in v[0]) and k != ident}
            self._kvs = dict(list(live.items())[-(KEEP_PROMPTS - 1):])
            drop = _dropper(self, ident)
            self._kvs[ident] = (tuple(weakref.ref(t, drop) for t in inputs), tuple(t._version for t in inputs), sig,
                                kvs)
        return kvs

    def __len__(self) -> int:
        """Entries held (prompt tuples with their keys and values)."""
        return len(self._kvs)


def _dropper(cache: PromptCache, ident: tuple):
    """A weakref callback that removes ``cache``'s entry ``ident`` when one of its inputs is freed (only the entry
    that holds the dying reference: an id can be reused by a later tensor once its object is gone)."""
    cache_ref = weakref.ref(cache)

    def drop(dead: weakref.ref) -> None:
        c = cache_ref()
        entry = None if c is None else c._kvs.get(ident)
        if entry is not None and any(r is dead for r in entry[0]):
            del c._kvs[ident]
    return drop
