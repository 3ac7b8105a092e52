"""Editing end to end (issue #45): fastwan vs diffusers' WanVACEPipeline and WanAnimatePipeline on the same random
weights, frames compared with diffusers eager's (GPU).

Jobs (--job):
  vace-1.3b    Wan2.1-VACE-1.3B (the 1.3B DiT, a control block after every 2nd block, 2.15e9 parameters), 480x832,
               81 frames, 50 steps, CFG 5 (diffusers' WanVACEPipeline defaults, fastwan's preset): a control video
               (smooth random frames), an inpainting mask (white in a centred box) and one reference image (a latent
               frame more: 22 x 30 x 52 = 34,320 tokens a pass)
  animate-14b  Wan2.2-Animate-14B (17.27e9 parameters: 32.2 GiB in bf16), 720x1280, one segment of 77 frames, 20
               steps, no CFG (the preset), animate mode: the character image, a pose video and a face video (77
               frames each; the face at the DiT's motion encoder size, 512x512); 21 + 1 latent frames, 79,200 tokens
Phases (each appends to the JSON given by --out, so they can run in separate processes, in any order):
  make             write the job's random checkpoint at the real shapes to --ckpt (benchmarks.checkpoints:
                   bf16 DiT and UMT5-XXL, fp32 VAE; Animate a ViT-H CLIP); --text-encoder-from links the UMT5-XXL
  diffusers        the diffusers pipeline end to end (bf16 DiT, fp32 VAE and CLIP as diffusers' examples load
                   them), per-step times from its step callback, frames saved for the comparison
  diffusers_tuned  the same with compile_repeated_blocks(fullgraph=True) and the _native_cudnn attention backend
  fastwan          VideoGenerator.generate_video in bf16, the DiT compiled (--no-compile: eager), frames compared
Each pipeline: one untimed warm-up (1 step eager, 2 compiled), then one timed run (seed 0). Random weights have the
FLOPs and kernels of the real model; video quality is not measured here.

On one H200 (estimates from RESULTS.md's H100 figures; each call at most 10 minutes). The calls of a job run back
to back on one machine (its /tmp lasts while it is held), and end by copying the JSON to $OUT:
  python -m benchmarks.editing_e2e --job vace-1.3b --phase make,diffusers,fastwan --ckpt /tmp/vace13 \\
      --out /tmp/editing.json                                    # ~6 min: make ~1.5, diffusers ~2.5, fastwan ~2
  python -m benchmarks.editing_e2e --job vace-1.3b --phase diffusers_tuned --ckpt /tmp/vace13 --out /tmp/editing.json
                                                                  # ~3 min (compiling ~0.5)
  Peaks about 25 GiB (UMT5-XXL 11 GiB, DiT 4 GiB, the fp32 VAE's decode); 16 GB of disk.
  python -m benchmarks.editing_e2e --job animate-14b --phase make --ckpt /tmp/animate14 --out /tmp/editing.json
                                                                  # ~3 min: 48 GB written (disk: 64 GiB)
  python -m benchmarks.editing_e2e --job animate-14b --phase fastwan --ckpt /tmp/animate14 --out /tmp/editing.json
                                                                  # ~6 min: load 1, warm-up 1.5, 20 x ~10.5 s
  python -m benchmarks.editing_e2e --job animate-14b --phase diffusers --ckpt /tmp/animate14 --out /tmp/editing.json
                                                                  # ~7 min: load 1.5, 20 x ~14 s, fp32 VAE
  python -m benchmarks.editing_e2e --job animate-14b --phase diffusers_tuned --ckpt /tmp/animate14 \\
      --out /tmp/editing.json                                    # ~7.5 min (compiling ~1.5)
  Peaks about 50-65 GiB each (DiT 32.2 GiB, UMT5-XXL 10.6, CLIP 2.4 fp32, activations, the VAE); each phase loads
  its own copy and frees it. The four Animate calls (~24 min) do not fit one session's 30 minutes with the machine's
  start: run make, fastwan, diffusers in one session (frames compared), make, diffusers_tuned in the next; or
  --video 480x832x77 (about 2.3x fewer FLOPs a step) to run all four in one.

  python -m benchmarks.editing_e2e --smoke --job vace-1.3b      # CI: the job's tiny checkpoint on the CPU, 2 steps
  python -m benchmarks.editing_e2e --smoke --job animate-14b
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from benchmarks.checkpoints import make_checkpoint, transformer_config
from benchmarks.harness import (
    NEG, PEERS, PROMPT, bench_dtype, frames_path, log, parse_args, release)
from benchmarks.i2v import add_job_arguments, bench_image, diffusers_i2v, run_phases, timed_diffusers, timed_fastwan


class Job(NamedTuple):
    task: str  # the checkpoint's task (benchmarks.checkpoints.make_checkpoint)
    size: str  # the DiT's size (benchmarks.harness.DIT_SIZES)
    pipeline: str  # diffusers' pipeline class
    height: int
    width: int
    frames: int  # the video's (Animate: one segment's)
    steps: int
    guidance: float


JOBS = {
    "vace-1.3b": Job("vace", "1.3b", "WanVACEPipeline", 480, 832, 81, 50, 5.0),
    "animate-14b": Job("animate", "14b", "WanAnimatePipeline", 720, 1280, 77, 20, 1.0),
}


def smooth_video(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    """A deterministic uint8 video [frames, height, width, 3]: a coarse random colour field, upsampled, that drifts
    one pixel a frame (smooth content that moves, like a control or driving video's for the encoders)."""
    from PIL import Image

    coarse = np.random.default_rng(seed).integers(0, 256, (height // 32 + 2, width // 32 + 2, 3), dtype=np.uint8)
    big = np.asarray(Image.fromarray(coarse).resize((width + frames, height + frames), Image.BILINEAR))
    return np.stack([big[k:k + height, k:k + width] for k in range(frames)])


def box_mask(frames: int, height: int, width: int) -> np.ndarray:
    """An inpainting mask [frames, height, width, 3]: white (generated) in the centred box of half the sides, black
    (kept) around it."""
    m = np.zeros((frames, height, width, 3), np.uint8)
    m[:, height // 4:height // 4 + height // 2, width // 4:width // 4 + width // 2] = 255
    return m


def job_inputs(job: str, root: Path, video: tuple[int, int, int]) -> dict[str, np.ndarray | list[np.ndarray]]:
    """The job's conditioning as uint8 arrays: VACE's ``video``, ``mask`` and ``reference_images`` (one image of
    half the sides, fitted onto the frame by both pipelines); Animate's ``image``, ``pose_video`` and ``face_video``
    (at the checkpoint DiT's motion encoder size)."""
    h, w, f = video
    if JOBS[job].task == "vace":
        return {"video": smooth_video(f, h, w, seed=0), "mask": box_mask(f, h, w),
                "reference_images": [bench_image(max(h // 2, 16), max(w // 2, 16))]}
    face = transformer_config(root)["motion_encoder_size"]
    return {"image": bench_image(h, w), "pose_video": smooth_video(f, h, w, seed=1),
            "face_video": smooth_video(f, face, face, seed=2)}


def as_pil(value):
    """An input of :func:`job_inputs` as diffusers takes it: an image -> PIL image, a video or a list -> PIL list."""
    from PIL import Image

    if isinstance(value, list) or value.ndim == 4:
        return [Image.fromarray(x) for x in value]
    return Image.fromarray(value)


def phase_diffusers(root: Path, job: str, video: tuple[int, int, int], steps: int, res: dict, out: Path,
                    tuned: bool, device: torch.device) -> None:
    """diffusers' pipeline of the job end to end (:func:`benchmarks.i2v.timed_diffusers`)."""
    h, w, f = video
    spec = JOBS[job]
    pipe = diffusers_i2v(root, tuned, device, spec.pipeline)
    kw = dict(prompt=PROMPT, negative_prompt=NEG, height=h, width=w, guidance_scale=spec.guidance,
              **{k: as_pil(v) for k, v in job_inputs(job, root, video).items()})
    if spec.task == "animate":
        kw.update(segment_frame_length=f, prev_segment_conditioning_frames=1, mode="animate")
    else:
        kw["num_frames"] = f
    key = f"{job}:diffusers_tuned" if tuned else f"{job}:diffusers"
    res[key] = timed_diffusers(pipe, kw, steps, tuned, device, frames_path(out, key))
    res[key]["setup"] = PEERS["diffusers_tuned" if tuned else "diffusers"] + (
        ", fp32 CLIP" if spec.task == "animate" else "")
    log(f"{key}: {res[key]['seconds']:.2f} s, {res[key]['s_per_step_median']} s/step, peak {res[key]['peak_gib']} "
        "GiB")
    del pipe
    release(tuned, device)


def phase_fastwan(root: Path, job: str, video: tuple[int, int, int], steps: int, res: dict, out: Path,
                  compile_: bool, cfg_mode: str, device: torch.device) -> None:
    """fastwan's VideoGenerator end to end (:func:`benchmarks.i2v.timed_fastwan`)."""
    from fastwan import VideoGenerator

    h, w, f = video
    spec = JOBS[job]
    gen = VideoGenerator.from_pretrained(root, device=device, dtype=bench_dtype(device), cfg_mode=cfg_mode,
                                         enable_torch_compile=compile_)
    kw = dict(negative_prompt=NEG, height=h, width=w, guidance_scale=spec.guidance,
              **{k: list(v) if k == "reference_images" else v for k, v in job_inputs(job, root, video).items()})
    if spec.task == "animate":
        kw.update(segment_frames=f, overlap=1)
    else:
        kw["num_frames"] = f
    key = f"{job}:fastwan[{cfg_mode}{',compiled' if compile_ else ''},{steps} steps]"
    res[key] = timed_fastwan(gen, kw, steps, device, frames_path(out, key))
    log(f"{key}: {res[key]['seconds']:.2f} s ({res[key]['s_per_step']:.3f} s/step), peak {res[key]['peak_gib']} "
        f"GiB, timings {res[key]['timings']}")
    del gen
    release(compile_, device)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.editing_e2e", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    add_job_arguments(p, tuple(JOBS), "/tmp/wan-editing-random", "editing_e2e.json", compile_default=True,
                      video_help="height x width x frames (Animate: one segment's frames; default: the job's)")
    p.add_argument("--text-encoder-from", default=None, metavar="CKPT",
                   help="make: link the UMT5-XXL of this random checkpoint instead of writing one (11 GB of disk)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    a = parse_args(p, argv)
    spec = JOBS[a.job]
    te_from = None if a.text_encoder_from is None else Path(a.text_encoder_from)
    if te_from is not None and not (te_from / "text_encoder").is_dir():
        p.error(f"--text-encoder-from {te_from}: no text_encoder folder there; give a checkpoint made by "
                "benchmarks.checkpoints, or leave the flag out to write a UMT5-XXL")

    def make(root: Path, device: torch.device) -> None:
        make_checkpoint(root, "tiny" if a.smoke else spec.size, task=spec.task, device=device,
                        text_encoder_from=te_from)

    return run_phases(p, a, argv, spec.steps, (spec.height, spec.width, spec.frames), make, phase_diffusers,
                      phase_fastwan)


if __name__ == "__main__":
    sys.exit(main())
