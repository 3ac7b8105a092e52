"""The task-dependent parts of :mod:`benchmarks.forward_14b`: for each task, diffusers' DiT class and arguments,
fastwan's :class:`~fastwan.models.WanConfig` of the same DiT, the inputs of one forward and how each side takes
them (:class:`Conditioning`).

* ``t2v``, ``i2v``, ``i2v-a14b``: ``WanTransformer3DModel`` at :data:`benchmarks.harness.TASKS`' shapes (i2v: 257
  CLIP tokens, given to both sides as a forward argument).
* ``vace`` (Wan2.1-VACE-14B): ``WanVACETransformer3DModel``, the size's DiT plus a control block after every
  :data:`VACE_LAYERS` block of the size (14b: 0, 5, .., 35, diffusers' defaults and the published config),
  ``vace_in_channels`` 96. Control latents [1, 96, F, h, w] (one per latent frame, no reference frames) and a scale
  of 1 per VACE layer: diffusers reads them as ``control_hidden_states`` (expanded to the batch, as its pipeline
  does) and ``control_hidden_states_scale`` (in the model dtype, as its pipeline casts it); fastwan runs under
  :func:`fastwan.models.wan.vace.vace_control`.
* ``animate`` (Wan2.2-Animate-14B): ``WanAnimateTransformer3DModel`` at the published config (diffusers' class
  defaults, with ``added_kv_proj_dim`` 5120 as the published config.json has: the CLIP tokens' own keys and
  values): the i2v DiT (36 input channels, 257 CLIP tokens of 1280) plus the pose embedding, the motion encoder
  (face frames of 512 x 512), the face encoder and a face adapter after every 5th block. ``--video HxWxS`` is one
  segment of S frames: the latents have (S - 1) / 4 + 1 frames plus the reference's (77 -> 20 + 1 = 21), the pose
  latents one fewer, the face video S frames of 512 x 512 in [-1, 1]. diffusers reads them as
  ``pose_hidden_states``, ``face_pixel_values`` and ``encoder_hidden_states_image``; fastwan runs under
  :func:`fastwan.models.wan.animate.animate_inputs`, attached for each forward, so that each forward runs the motion
  and face encoders over the face video as diffusers' does (within a pipeline's segment fastwan makes the face
  tokens once for all steps; a forward here does not).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from benchmarks.harness import TASKS, dit_kwargs, forward_inputs

IMAGE_TOKENS = 257  # CLIP's penultimate states of one image
VACE_IN_CHANNELS = 96  # the VAE latents of the inactive and reactive video (2 x 16) and the 8 x 8 mask (64)
VACE_LAYERS = MappingProxyType({  # size -> the blocks a VACE hint follows (Wan2.1-VACE-14B / -1.3B's configs)
    "14b": tuple(range(0, 40, 5)), "1.3b": tuple(range(0, 30, 2)), "tiny": (0, 1)})
TINY_ANIMATE = MappingProxyType(dict(  # --smoke: a 16 x 16 face, a face adapter after each of the two blocks
    motion_encoder_size=16, motion_encoder_channel_sizes={"4": 8, "8": 8, "16": 8}, motion_style_dim=8,
    motion_dim=4, motion_encoder_dim=8, face_encoder_hidden_dim=8, face_encoder_num_heads=2,
    inject_face_latents_blocks=1))
EDIT_TASKS = ("vace", "animate")
TASK_CHOICES = (*TASKS, *EDIT_TASKS)
VIDEOS = MappingProxyType({"vace": "480x832x81", "animate": "720x1280x77"})  # the task's job; the others: 720p x 81
CLASS_NAMES = MappingProxyType({"vace": "WanVACETransformer3DModel", "animate": "WanAnimateTransformer3DModel"})


def default_video(task: str) -> str:
    """The ``--video`` of a task's job: VACE at 480p x 81 frames, an Animate segment at 720p x 77, else 720p x 81."""
    return VIDEOS.get(task, "720x1280x81")


def peer_class(task: str):
    """diffusers' DiT class of ``task``."""
    import diffusers

    return getattr(diffusers, CLASS_NAMES.get(task, "WanTransformer3DModel"))


def peer_kwargs(size: str, task: str) -> dict:
    """diffusers' DiT arguments of a size (:data:`benchmarks.harness.DIT_SIZES`) and task (:data:`TASK_CHOICES`)."""
    if task == "vace":
        return {**dit_kwargs(size), "vace_layers": list(VACE_LAYERS[size]), "vace_in_channels": VACE_IN_CHANNELS}
    if task == "animate":  # the i2v DiT (36 channels, CLIP tokens with their own keys and values), latents of 16
        return {**dit_kwargs(size, "i2v"), "latent_channels": 16, **(TINY_ANIMATE if size == "tiny" else {})}
    return dit_kwargs(size, task)


def fastwan_config(size: str, task: str):
    """fastwan's :class:`~fastwan.models.WanConfig` of the DiT :func:`peer_kwargs` describes."""
    from fastwan.models import WanConfig

    return WanConfig.from_dict({"_class_name": CLASS_NAMES.get(task, "WanTransformer3DModel"),
                                **peer_kwargs(size, task)})


@dataclass(frozen=True)
class Conditioning:
    """What one forward reads beyond (latents, timestep, text): ``peer``, diffusers' keyword arguments; ``ours``,
    fastwan's; ``hook``, the context (model -> context manager) fastwan's forward runs in; ``shapes``, the inputs'
    shapes for the results."""

    peer: dict = field(default_factory=dict)
    ours: dict = field(default_factory=dict)
    hook: Callable = field(default=lambda model: contextlib.nullcontext())
    shapes: dict = field(default_factory=dict)

    def run(self, model, args: tuple) -> torch.Tensor:
        """fastwan's ``model`` on ``args`` (latents, timestep, text) with these inputs."""
        with self.hook(model):
            return model(*args, **self.ours)


def job_inputs(task: str, config, batch: int, h: int, w: int, f: int, prompt_tokens: int,
               device: torch.device | str, dtype: torch.dtype) -> tuple[tuple, Conditioning]:
    """((latents, timestep, text), :class:`Conditioning`) of one forward of ``task`` on the diffusers DiT whose
    ``config`` it is, at ``batch`` videos of ``h`` x ``w`` x ``f`` frames (animate: a segment of ``f`` frames, the
    latents one frame more: the reference's), on ``device`` in ``dtype``; seeded, so every run draws the same."""
    frames = f + 4 if task == "animate" else f
    args = forward_inputs(batch, in_ch=config.in_channels, h=h, w=w, f=frames, prompt_tokens=prompt_tokens,
                          device=device, dtype=dtype)
    lat = args[0].shape[2:]
    g = torch.Generator(device).manual_seed(1)

    def draw(*shape):
        return torch.randn(*shape, device=device, generator=g).to(dtype)

    image = None if config.image_dim is None else draw(batch, IMAGE_TOKENS, config.image_dim)
    shapes = {} if image is None else {"image": list(image.shape)}
    if task == "vace":
        from fastwan.models.wan.vace import vace_control

        control = draw(1, config.vace_in_channels, *lat)
        scales = [1.0] * len(config.vace_layers)
        peer = {"control_hidden_states": control.expand(batch, -1, -1, -1, -1),
                "control_hidden_states_scale": torch.tensor(scales, device=device, dtype=dtype)}
        return args, Conditioning(peer, {}, lambda model: vace_control(model, control, scales),
                                  {"control": list(control.shape), "vace_layers": list(config.vace_layers)})
    if task == "animate":
        from fastwan.models.wan.animate import animate_inputs

        pose = draw(batch, config.latent_channels, lat[0] - 1, *lat[1:])
        size = config.motion_encoder_size
        face = (torch.rand(batch, 3, f, size, size, device=device, generator=g) * 2 - 1).to(dtype)
        peer = {"encoder_hidden_states_image": image, "pose_hidden_states": pose, "face_pixel_values": face}
        return args, Conditioning(peer, {"image": image}, lambda model: animate_inputs(model, pose, face),
                                  {**shapes, "pose": list(pose.shape), "face": list(face.shape),
                                   "face_adapters": config.num_layers // config.inject_face_latents_blocks})
    if image is None:
        return args, Conditioning()
    return args, Conditioning({"encoder_hidden_states_image": image}, {"image": image}, shapes=shapes)

