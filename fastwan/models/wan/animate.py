"""Wan2.2-Animate in the Wan DiT: the pose latents added to the stream, and the face video turned into face tokens
that face adapters attend to after every ``inject_face_latents_blocks``-th block.

An Animate DiT (``WanAnimateTransformer3DModel``; :attr:`WanConfig.animate`) is an image-conditioned Wan DiT (its
latents: noise, reference latents and mask, ``in_channels`` = 2 x ``latent_channels`` + 4) with, beside the blocks:

* ``pose_patch_embedding``: the pose latents [B, latent_channels, F - 1, H, W] patch-embedded and added to the token
  frames 1 .. F - 1 (frame 0, the reference image's, gets none);
* ``motion_encoder`` (:class:`MotionEncoder`): each face frame [3, size, size] (pixels in [-1, 1]) -> a motion vector
  of ``motion_encoder_dim``, through a convolutional appearance encoder, ``motion_blocks`` linears and the
  projection on the orthonormalised ``motion_synthesis_weight`` (its QR in fp32);
* ``face_encoder`` (:class:`FaceEncoder`): the motion vectors of S frames [B, S, motion_encoder_dim] -> face tokens
  [B, T, heads + 1, C]: causal 1-D convolutions over time (the 2nd and 3rd of stride 2: T = ceil(ceil(S / 2) / 2)),
  one token per face-encoder head plus a learned padding token; a zero frame is put first, so the tokens have
  T + 1 frames, which must be the latents' F;
* ``face_adapter`` (:class:`FaceAdapter`, one per group of ``inject_face_latents_blocks`` blocks): after block
  ``k * inject`` the stream gets ``face_adapter[k](x, tokens)``, a cross-attention in which each token frame attends
  to its own frame's face tokens.

These inputs are not arguments of the forward: :func:`animate_inputs` attaches an :class:`AnimateInputs` hook
(:mod:`fastwan.hooks`) for a run, which adds the pose tokens at the call point ``embed`` and the face adapters'
outputs at the points ``block_calls.i``; ``run_cfg`` runs both CFG passes through ``run_blocks`` (each pass may
read its own face video; the passes share no block-0 half). The face tokens depend on the face video alone, so the
hook computes them once for all the steps of its run. An Animate DiT with no hook attached is refused at ``embed``
(diffusers' forward has no form without pose and face).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastwan.errors import InvalidArgument
from fastwan.hooks import Hook, HookRegistry
from fastwan.models.wan.block import Residual, settle
from fastwan.models.wan.config import WanConfig

HOOK_NAME = "animate"
BLUR = (1.0, 3.0, 3.0, 1.0)  # the FIR filter applied before the motion encoder's downsampling convolutions
MOTION_BLOCKS = 5  # linears of the motion network (diffusers' fixed count)


class ScaledConv(nn.Module):
    """A 2-D convolution whose weight is scaled by 1 / sqrt(fan_in) when used, optionally after a blur (the FIR
    :data:`BLUR`, outer product, normalised) and followed by a leaky ReLU (slope 0.2, gain sqrt(2)) with its bias
    ``act_fn.bias``; without the activation, ``bias`` (or none)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, padding: int = 0, bias: bool = True,
                 blur: bool = False, act: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cout, cin, kernel, kernel))
        self.scale = 1 / math.sqrt(cin * kernel ** 2)
        self.stride, self.padding, self.cin = stride, padding, cin
        self.bias = nn.Parameter(torch.empty(cout)) if bias and not act else None
        self.act_fn = LeakyBias(cout) if act else None
        self.blur_padding = None
        self._blur: dict = {}  # (device, dtype) -> the blur kernel, made at first use there
        if blur:
            p = len(BLUR) - stride + kernel - 1
            self.blur_padding = ((p + 1) // 2, p // 2)

    def blur_kernel(self, like: torch.Tensor) -> torch.Tensor:
        """The depthwise blur kernel [cin, 1, 4, 4] on ``like``'s device and dtype, made once there (not a buffer: a
        module built on the meta device has no values; made per call, its host-to-device copy would sync the stream
        every call)."""
        key = (like.device, like.dtype)
        if key not in self._blur:
            k = torch.tensor(BLUR, dtype=like.dtype, device=like.device)
            self._blur[key] = (torch.outer(k, k) / k.sum() ** 2)[None, None].expand(self.cin, 1, -1, -1)
        return self._blur[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blur_padding is not None:
            x = F.conv2d(x, self.blur_kernel(x), padding=self.blur_padding, groups=self.cin)
        x = F.conv2d(x.to(self.weight.dtype), self.weight * self.scale, self.bias, self.stride, self.padding)
        return x if self.act_fn is None else self.act_fn(x, 1)


class LeakyBias(nn.Module):
    """Bias on the channel dim, then leaky ReLU (slope 0.2) times sqrt(2)."""

    def __init__(self, channels: int):
        super().__init__()
        self.bias = nn.Parameter(torch.empty(channels))

    def forward(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        shape = [1] * x.dim()
        shape[dim] = -1
        return F.leaky_relu(x + self.bias.view(shape), 0.2) * math.sqrt(2)


class ScaledLinear(nn.Module):
    """A linear layer whose weight is scaled by 1 / sqrt(in_features) when used."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cout, cin))
        self.bias = nn.Parameter(torch.empty(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight / math.sqrt(self.weight.shape[1]), self.bias)


class DownBlock(nn.Module):
    """Residual block halving the resolution: (conv 3x3, blurred conv 3x3 stride 2) + blurred conv 1x1 stride 2,
    the sum over sqrt(2)."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1 = ScaledConv(cin, cin, 3, padding=1)
        self.conv2 = ScaledConv(cin, cout, 3, stride=2, blur=True)
        self.conv_skip = ScaledConv(cin, cout, 1, stride=2, bias=False, blur=True, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.conv2(self.conv1(x)) + self.conv_skip(x)) / math.sqrt(2)


class MotionEncoder(nn.Module):
    """Face frames [N, 3, size, size] -> motion vectors [N, motion_encoder_dim] (see the module docstring)."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        size, channels = cfg.motion_encoder_size, dict(cfg.motion_encoder_channel_sizes)
        self.size = size
        self.conv_in = ScaledConv(3, channels[size], 1)
        self.res_blocks = nn.ModuleList()
        res = size
        while res > 4:
            self.res_blocks.append(DownBlock(channels[res], channels[res // 2]))
            res //= 2
        style = cfg.motion_style_dim
        self.conv_out = ScaledConv(channels[4], style, 4, bias=False, act=False)
        self.motion_network = nn.ModuleList([ScaledLinear(style, style) for _ in range(MOTION_BLOCKS - 1)]
                                            + [ScaledLinear(style, cfg.motion_dim)])
        self.motion_synthesis_weight = nn.Parameter(torch.empty(cfg.motion_encoder_dim, cfg.motion_dim))

    def directions(self) -> torch.Tensor:
        """The motion directions: an orthonormal basis of the synthesis weight's columns (QR in fp32)
        [motion_encoder_dim, motion_dim]."""
        return torch.linalg.qr((self.motion_synthesis_weight + 1e-8).float())[0]

    def forward(self, faces: torch.Tensor, directions: torch.Tensor | None = None) -> torch.Tensor:
        """``directions``: :meth:`directions` made once by a caller that runs several batches of frames (None:
        made here)."""
        x = self.conv_in(faces)
        for blk in self.res_blocks:
            x = blk(x)
        alpha = self.conv_out(x).flatten(1)  # [N, style] (4x4 -> 1x1)
        for lin in self.motion_network:
            alpha = lin(alpha)
        q = self.directions() if directions is None else directions
        return (alpha.float() @ q.T).to(alpha.dtype)


class FaceEncoder(nn.Module):
    """Motion vectors [B, S, motion_encoder_dim] -> face tokens [B, T, heads + 1, C] (see the module docstring)."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        hidden, self.heads = cfg.face_encoder_hidden_dim, cfg.face_encoder_num_heads
        self.conv1_local = nn.Conv1d(cfg.motion_encoder_dim, hidden * self.heads, 3)
        self.conv2 = nn.Conv1d(hidden, hidden, 3, stride=2)
        self.conv3 = nn.Conv1d(hidden, hidden, 3, stride=2)
        self.norm = nn.LayerNorm(hidden, cfg.eps, elementwise_affine=False)
        self.out_proj = nn.Linear(hidden, cfg.inner_dim)
        self.padding_tokens = nn.Parameter(torch.empty(1, 1, 1, cfg.inner_dim))

    def forward(self, motion: torch.Tensor) -> torch.Tensor:
        B = motion.shape[0]
        x = motion.transpose(1, 2)  # [B, C, S]
        for i, conv in enumerate((self.conv1_local, self.conv2, self.conv3)):
            # causal in time: the first frame repeated twice before the sequence
            x = conv(F.pad(x, (2, 0), mode="replicate"))
            if i == 0:  # one sequence per head: [B, heads * C, S] -> [B * heads, C, S]
                x = x.unflatten(1, (self.heads, -1)).flatten(0, 1)
            x = F.silu(self.norm(x.transpose(1, 2))).transpose(1, 2)
        x = self.out_proj(x.transpose(1, 2))  # [B * heads, T, C]
        x = x.unflatten(0, (B, self.heads)).transpose(1, 2)  # [B, T, heads, C]
        return torch.cat([x, self.padding_tokens.expand(B, x.shape[1], 1, -1).to(x.dtype)], dim=2)


class FaceAdapter(nn.Module):
    """Cross-attention from each token frame of the stream to its frame's face tokens (LayerNorms without affine on
    both inputs, per-head RMSNorm on q and k) -> what is added to the stream [B, S, C]."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        dim, self.heads = cfg.inner_dim, cfg.num_attention_heads
        self.pre_norm_q = nn.LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.pre_norm_kv = nn.LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = nn.RMSNorm(cfg.attention_head_dim, eps=cfg.eps)
        self.norm_k = nn.RMSNorm(cfg.attention_head_dim, eps=cfg.eps)

    def forward(self, x: torch.Tensor, face: torch.Tensor, attention) -> torch.Tensor:
        """x [B, S, C] (raster order, S = T x tokens per frame); face [B, T, N, C]; ``attention``: the DiT's
        :class:`~fastwan.attention.AttentionDispatch` (its cross-attention)."""
        B, T, N, _ = face.shape
        q = self.norm_q(self.to_q(self.pre_norm_q(x)).unflatten(2, (self.heads, -1)))
        kv = self.pre_norm_kv(face).flatten(1, 2)
        k = self.norm_k(self.to_k(kv).unflatten(2, (self.heads, -1)))
        v = self.to_v(kv).unflatten(2, (self.heads, -1))
        q = q.unflatten(1, (T, -1)).flatten(0, 1)  # [B * T, S / T, H, D]
        k, v = (t.unflatten(1, (T, N)).flatten(0, 1) for t in (k, v))  # [B * T, N, H, D]
        out = attention.cross_attention(q, k, v).type_as(q).flatten(2)
        return self.to_out(out.unflatten(0, (B, T)).flatten(1, 2))


def animate_modules(cfg: WanConfig) -> dict[str, nn.Module | None]:
    """The Animate DiT's modules beside the blocks, by attribute name (None each for a DiT that is not Animate's)."""
    names = ("pose_patch_embedding", "motion_encoder", "face_encoder", "face_adapter")
    if not cfg.animate:
        return dict.fromkeys(names)
    pose = nn.Conv3d(cfg.latent_channels, cfg.inner_dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
    adapters = nn.ModuleList([FaceAdapter(cfg) for _ in range(cfg.num_layers // cfg.inject_face_latents_blocks)])
    return dict(zip(names, (pose, MotionEncoder(cfg), FaceEncoder(cfg), adapters)))


def face_frames(frames: int) -> int:
    """The token frames of the face tokens of ``frames`` face frames (the face encoder's two stride-2 convolutions,
    then the zero frame put first)."""
    return (frames + 3) // 4 + 1


def _check_inputs(cfg: WanConfig, pose: torch.Tensor, faces: tuple) -> None:
    """Shapes of a run's pose latents [B, latent_channels, F - 1, H, W] and face videos [B, 3, S, size, size]."""
    if not (isinstance(pose, torch.Tensor) and pose.dim() == 5 and pose.shape[1] == cfg.latent_channels):
        raise InvalidArgument(f"pose latents {_shape(pose)} must be [B, {cfg.latent_channels}, F - 1, H, W] (this "
                              f"DiT's latent_channels, one frame fewer than the latents).")
    size = cfg.motion_encoder_size
    for face in faces:
        if not (isinstance(face, torch.Tensor) and face.dim() == 5 and face.shape[1] == 3
                and face.shape[3:] == (size, size)):
            raise InvalidArgument(f"face video {_shape(face)} must be [B, 3, S, {size}, {size}] (RGB frames in [-1, 1] "
                                  f"at this DiT's motion_encoder_size={size}); resize the face crops to {size}x{size}.")


def _shape(value) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else f"{value!r} ({type(value).__name__})"


def face_tokens(model, face: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
    """Face video [B, 3, S, size, size] -> face tokens [B, T + 1, heads + 1, C] (the zero frame first), the motion
    encoder run on ``batch_size`` frames at a time (default: the config's motion_encoder_batch_size)."""
    B, _, S = face.shape[:3]
    frames = face.to(model.dtype).transpose(1, 2).flatten(0, 1)  # [B * S, 3, size, size]
    step = batch_size or model.config.motion_encoder_batch_size
    q = model.motion_encoder.directions()  # once for every batch of frames
    motion = torch.cat([model.motion_encoder(f, q) for f in frames.split(step)]).unflatten(0, (B, S))
    tokens = model.face_encoder(motion)
    return torch.cat([torch.zeros_like(tokens[:, :1]), tokens], dim=1)


class AnimateInputs(Hook):
    """The pose and face inputs of one run on an Animate DiT (see the module docstring): ``pose`` latents
    [B or 1, latent_channels, F - 1, H, W], ``face`` video [B or 1, 3, S, size, size] (S frames giving F token
    frames: :func:`face_frames`), ``face_uncond`` the face video of CFG's unconditional pass (None: ``face``)."""

    name = HOOK_NAME

    def __init__(self, pose: torch.Tensor, face: torch.Tensor, face_uncond: torch.Tensor | None = None,
                 motion_batch_size: int | None = None):
        self.pose, self.faces = pose, (face, face if face_uncond is None else face_uncond)
        self.motion_batch_size = motion_batch_size
        self._tokens: dict[int, torch.Tensor] = {}  # face tokens by pass (0: cond, 1: uncond), made on first use
        self._face: torch.Tensor | None = None  # the face tokens the current forward's adapters read

    def attach(self, module) -> None:
        _check_inputs(module.config, self.pose, self.faces)
        if "sequence_parallel" in HookRegistry.of(module):
            raise InvalidArgument("an Animate DiT runs on one GPU: its face adapters attend per token frame, which "
                                  "sequence parallelism splits; load it without sequence parallelism.")

    def points(self, module) -> dict:
        every = module.config.inject_face_latents_blocks
        points = {"embed": self._embed, "run_blocks": self._run_blocks, "run_cfg": self._run_cfg}
        for k in range(len(module.face_adapter)):
            points[f"block_calls.{k * every}"] = self._after(k)
        return points

    def tokens(self, module, which: int) -> torch.Tensor:
        if which not in self._tokens:
            self._tokens[which] = face_tokens(module, self.faces[which], self.motion_batch_size)
        return self._tokens[which]

    def _embed(self, module, inner, latents, timestep):
        e = inner(latents, timestep)
        B, _, F_, H, W = latents.shape
        if not (self.pose.shape[0] in (1, B) and self.pose.shape[2:] == (F_ - 1, H, W)):
            raise InvalidArgument(f"pose latents {_shape(self.pose)} must be [{B if B == 1 else f'{B} or 1'}, "
                                  f"{module.config.latent_channels}, {F_ - 1}, {H}, {W}] for latents "
                                  f"{_shape(latents)} (every latent frame but the first, the reference's).")
        for face in self.faces:
            if not (face.shape[0] in (1, B) and face_frames(face.shape[2]) == e.grid[0]):
                raise InvalidArgument(f"face video {_shape(face)} gives {face_frames(face.shape[2])} token frames "
                                      f"but the latents have {e.grid[0]}; pass {4 * (e.grid[0] - 1) - 3} to "
                                      f"{4 * (e.grid[0] - 1)} face frames (a segment's frames, 4 per latent frame).")
        pose = module.pose_patch_embedding(self.pose.to(module.dtype))
        pose = F.pad(pose, (0, 0, 0, 0, 1, 0)).flatten(2).transpose(1, 2)  # frame 0 (the reference's) gets none
        if e.layout is not None:
            pose = e.layout.permute_compact(pose, dim=1)
        return e._replace(x=(e.x + pose).contiguous())

    def _run_blocks(self, module, inner, e, contexts, step_index, num_steps):
        if self._face is not None:  # run_cfg chose the passes' tokens
            return inner(e, contexts, step_index, num_steps)
        self._face = self.tokens(module, 0)
        try:
            return inner(e, contexts, step_index, num_steps)
        finally:
            self._face = None

    def _run_cfg(self, module, inner, e, contexts, batched, step_index, num_steps):
        try:
            if batched:
                self._face = torch.cat([self.tokens(module, 0).expand(e.x.shape[0], -1, -1, -1),
                                        self.tokens(module, 1).expand(e.x.shape[0], -1, -1, -1)])
                both = e._replace(x=torch.cat([e.x, e.x]))
                return module.head(module.run_blocks(both, contexts, step_index, num_steps), both).chunk(2)
            out = []
            for which, ctx in enumerate(contexts):
                self._face = self.tokens(module, which)
                out.append(module.head(module.run_blocks(e._replace(x=e.x.clone()), ctx, step_index, num_steps), e))
            return tuple(out)
        finally:
            self._face = None

    def _after(self, k: int):
        def add_face(module, inner, r, *args):
            r = inner(r, *args)
            x = settle(r)
            layout = args[-1].layout if args[-1] is not None and args[-1].compact else None
            raster = x if layout is None else layout.unpermute_compact(x, dim=1)
            face = self._face.expand(x.shape[0], -1, -1, -1)
            out = module.face_adapter[k](raster, face.to(x.dtype), module.attention)
            return Residual(x + (out if layout is None else layout.permute_compact(out, dim=1)))
        return add_face


@contextlib.contextmanager
def animate_inputs(model, pose: torch.Tensor, face: torch.Tensor, *, face_uncond: torch.Tensor | None = None,
                   motion_batch_size: int | None = None):
    """``model`` (an Animate :class:`~fastwan.models.wan.transformer.WanTransformer`) runs inside the block with
    the pose latents ``pose`` [B or 1, latent_channels, F - 1, H, W] (F: the latents' frames) and the face video
    ``face`` [B or 1, 3, S, size, size] (RGB in [-1, 1], size = motion_encoder_size, S frames giving F token
    frames: 4 (F - 1) - 3 .. 4 (F - 1)); ``face_uncond``: the face video forward_cfg's unconditional pass reads
    (None: ``face``; diffusers' pipeline passes ``face`` with every pixel -1); ``motion_batch_size``: face frames
    per motion-encoder call (default: the config's motion_encoder_batch_size)."""
    if not model.config.animate:
        raise InvalidArgument("this Wan DiT is not Wan2.2-Animate's (its config's _class_name is not "
                              "WanAnimateTransformer3DModel); pose and face inputs need an Animate checkpoint.")
    hook = HookRegistry.of(model).add(AnimateInputs(pose, face, face_uncond, motion_batch_size))
    try:
        yield hook
    finally:
        HookRegistry.of(model).remove(hook.name)
