"""The ``fastwan`` command: ``fastwan generate ...``, ``fastwan quantize ...`` and ``fastwan env``.

Errors: a user error (an exception in :data:`USER_ERRORS`) prints one line, ``fastwan: error: <message>`` (a
multi-line message joined with '; ' by :func:`fastwan.errors.one_line`), on stderr and exits 2; any other
exception is a bug and propagates with its traceback.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

from fastwan import envs
from fastwan.errors import USER_ERROR_EXIT, InvalidArgument, OneLineParser, UserError, one_line
from fastwan.options import BLOCKS

# The exceptions reported as one line (exit 2): fastwan's user errors. Every other exception is a bug.
USER_ERRORS: tuple[type[Exception], ...] = (UserError,)
LORA_EXPERTS = {"high": 0, "low": 1}  # --lora PATH:...:high|low -> the Wan2.2 A14B expert it goes into


class Parser(OneLineParser):
    """The fastwan command's parser (its subcommands' too, and the examples' scripts'): errors are one line
    starting with 'fastwan: error:', exit code 2."""

    label = "fastwan"


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="make a video from a text prompt (and an image)")
    p.add_argument("--prompt", required=True, type=_prompt_arg, help="what the video shows")
    p.add_argument("--model", default="tiny",
                   help="Hub id, Diffusers-format folder, or tiny / tiny-wan2.1 / tiny-wan2.2-a14b / tiny-wan2.2-ti2v "
                        "/ tiny-wan2.1-i2v / tiny-wan2.1-flf2v / tiny-wan2.2-i2v-a14b / tiny-fastwan2.1 (default: "
                        "tiny)")
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit of --model (Hub ids only)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="also read PyTorch pickle weights (.bin, .pt, ...) of the checkpoint and --lora files, "
                        "for sources you trust (unpickling can run code); default: safetensors only")
    p.add_argument("--negative-prompt", default=None, help="default: Wan's negative prompt")
    p.add_argument("--image", default=None, help="first frame (image-to-video checkpoints): an image file")
    p.add_argument("--last-image", default=None, help="last frame (first-last-frame checkpoints): an image file")
    p.add_argument("--height", type=_positive_int, default=None)
    p.add_argument("--width", type=_positive_int, default=None)
    p.add_argument("--num-frames", type=_positive_int, default=None, help="4k+1 frames, e.g. 81")
    p.add_argument("--steps", type=_positive_int, default=None, help="denoising steps")
    p.add_argument("--sampler", choices=("default", "euler", "dmd"), default=None,
                   help="default: the checkpoint's (its scheduler; dmd for FastWan); euler for step-distilled LoRAs")
    p.add_argument("--timesteps", type=_timesteps_arg, default=None, metavar="T1,T2,...",
                   help="euler / dmd timesteps in (0, 1000], decreasing, e.g. 1000,757,522 (sets the step count)")
    p.add_argument("--flow-shift", type=_shift_arg, default=None,
                   help="default: the preset's (8 for FastWan), else 8 for dmd (FastVideo's DMD stage) and the "
                        "checkpoint scheduler's otherwise")
    p.add_argument("--guidance-scale", type=_scale_arg, default=None)
    p.add_argument("--guidance-scale-2", type=_scale_arg, default=None,
                   help="low-noise expert's scale (Wan2.2 A14B; default: --guidance-scale when given, else the "
                        "preset's)")
    p.add_argument("--seed", type=_seed_arg, default=None, help="default: a random seed (printed)")
    p.add_argument("--fps", type=_positive_int, default=None)
    p.add_argument("--output", default="outputs/", help="folder, or a path ending in .mp4")
    p.add_argument("--overwrite", action="store_true", help="replace an existing video at the output path")
    p.add_argument("--attention-backend", default=None,
                   help="TORCH_SDPA, FLASH_ATTN, SAGE_ATTN, SLIDING_TILE_ATTN, VIDEO_SPARSE_ATTN, NEIGHBORHOOD_ATTN")
    p.add_argument("--attention-config", default=None,
                   help="the backend's settings: a JSON file, or inline JSON such as '{\"sparsity\": 0.9}'")
    p.add_argument("--compile", action="store_true", help="torch.compile the DiT blocks")
    p.add_argument("--dit-block", choices=BLOCKS, default="auto",
                   help="the DiT block: fast (fused kernels), reference (diffusers' rounding points), or auto (fast "
                        "where the kernels run)")
    p.add_argument("--cfg-gate-step", type=float, default=None, help="fraction of steps with full CFG (0..1)")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE][:high|low]",
                   help="merge a LoRA (.safetensors) into the DiT, with an optional strength; ':high' / ':low' "
                        "merges it into one Wan2.2 A14B expert only (high or low noise); repeatable")
    p.add_argument("--cache", default=None, metavar="TYPE[:KEY=VALUE,...]",
                   help="step cache: none, first_block, teacache, magcache or skip_steps, with settings, e.g. "
                        "teacache:threshold=0.1 or magcache:mag_ratios=@ratios.json (see fastwan.cache)")
    p.add_argument("--cfg-mode", choices=("auto", "batched", "sequential"), default="auto",
                   help="CFG as one batch of 2, two passes, or auto (two passes for large videos on CUDA)")
    p.add_argument("--vae-tiling", action="store_true",
                   help="decode in spatial tiles (diffusers' VAE tiling): ~5x less decode memory, ~2x slower decode")
    p.add_argument("--vae-chunk-frames", type=_chunk_arg, default="auto",
                   help="latent frames per VAE decoder call after the first: auto (default) or an int >= 1 "
                        "(1 = diffusers' frame-by-frame decode; more = faster, more decode memory)")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="fp8: e4m3 DiT weights with per-channel scales (half the memory; FP8 GEMMs on sm89+)")
    p.add_argument("--max-gpu-memory", default=None, metavar="SIZE",
                   help="GPU memory budget, e.g. 24GiB: offload / streaming levers are planned to fit it (printed)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--sp", type=_positive_int, default=None, metavar="N",
                   help="sequence-parallel degree: N processes (GPUs) split each pass's tokens (Ulysses); under "
                        "torchrun --nproc_per_node must equal N (x2 with --cfg-parallel), else fastwan starts them")
    p.add_argument("--cfg-parallel", action="store_true",
                   help="run the two CFG passes on two groups of --sp processes (2 x N processes)")


def _quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="write a copy of a Wan checkpoint with FP8 DiT weights")
    p.add_argument("--model", required=True, help="Hub id, Diffusers-format folder, or a tiny model name")
    p.add_argument("--output", required=True, help="the new checkpoint folder (other components are linked)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an output folder a former fastwan quantize wrote (no other folder is replaced)")
    p.add_argument("--device", default=None, help="where to quantize (default: cuda if available)")


def _prompt_arg(text: str) -> str:
    from fastwan.pipelines.text import clean_prompt

    if not clean_prompt(text):  # what the text encoder reads: HTML entities decoded, whitespace dropped
        raise argparse.ArgumentTypeError(f"the prompt {text!r} is empty once cleaned (HTML entities decoded, "
                                         "whitespace dropped); describe the video, e.g. 'a cat surfing a wave'")
    return text


def _real(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


def _scale_arg(text: str) -> float:
    value = _real(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0 (e.g. 5.0; 1.0 or less: no CFG)")
    return value


def _shift_arg(text: str) -> float:
    value = _real(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0 (e.g. 3.0 at 480p, 5.0 at 720p)")
    return value


def _seed_arg(text: str) -> int:
    value = _positive_int(text, "an int in [0, 2**64)", minimum=0)
    if value >= 2**64:
        raise argparse.ArgumentTypeError(f"{value} must be < 2**64")
    return value


def _timesteps_arg(text: str) -> list[float]:
    """'1000,757,522' -> [1000.0, 757.0, 522.0] (the generator checks the values). Rule: numbers separated by
    commas, each item one number (spaces around it allowed); an error names the first item that is not."""
    items, values = text.split(","), []
    for i, item in enumerate(items, 1):
        try:
            values.append(float(item))
        except ValueError:
            what = "is empty" if not item.strip() else f"{item.strip()!r} is not a number"
            raise argparse.ArgumentTypeError(
                f"{text!r}: item {i} of {len(items)} {what}; pass numbers separated by commas, e.g. 1000,757,522"
            ) from None
    return values


def _chunk_arg(text: str):
    """--vae-chunk-frames: 'auto' or an int >= 1 (argparse turns the ValueError into a usage error)."""
    if text == "auto":
        return text
    return _positive_int(text, "'auto' or an int >= 1", " (1 = frame-by-frame decode)")


def _positive_int(text: str, what: str = "an int >= 1", note: str = "", minimum: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}{note}")
    return value


def _num_gpus(args) -> int | None:
    """--sp and --cfg-parallel -> from_pretrained's num_gpus (None: one process). A torchrun job of several
    processes must split the work with them: without, every process would make the same video."""
    if args.sp is None and not args.cfg_parallel:
        launched = envs.torchrun_env()
        if launched is not None and launched[2] > 1:
            raise InvalidArgument(
                f"this job runs {launched[2]} processes (WORLD_SIZE={launched[2]}) but neither --sp nor "
                f"--cfg-parallel is given, so every process would make the same video; give --sp {launched[2]} "
                f"(or --cfg-parallel with --sp {max(1, launched[2] // 2)}), or run without torchrun."
            )
        return None
    return (args.sp or 1) * (2 if args.cfg_parallel else 1)


def _dtype_name(args, device: str) -> str:
    """--dtype, else bfloat16 on CUDA and float32 elsewhere. ``device`` is not parsed here: from_pretrained
    reports a bad --device."""
    if args.dtype is not None:
        return args.dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def _check_output(args) -> None:
    """The output destination's checks (:mod:`fastwan.pipelines.output`), before the model is loaded: a path
    that cannot be written, or an existing file without --overwrite, fails at once. generate_video checks again."""
    from fastwan.pipelines import output

    output.prepare_output(output.check_output_path(args.output, args.overwrite))


def _check_request(args, loras: list[tuple[str, float, int | None]]) -> None:
    """The video's arguments checked against the checkpoint's files before the model loads
    (:func:`fastwan.pipelines.request.check_request`; local folders and tiny models, as a Hub id would be
    downloaded first): a size, step count, guidance, sampler or step-cache mistake fails in seconds. generate_video
    checks again, with the attention backend's rules."""
    from fastwan.cache import check_cache, resolve_coefficients
    from fastwan.lora.merge import parse_lora_spec
    from fastwan.checkpoint.resolver import pipeline_index, resolve
    from fastwan.pipelines.request import check_request, checkpoint_vae_factors
    from fastwan.pipelines.setup import load_scheduler
    from fastwan.checkpoint.tiny import TINY_IDS

    parse_lora_spec(loras, args.allow_pickle)  # a missing LoRA file before anything is fetched
    if args.model not in TINY_IDS and not Path(args.model).expanduser().is_dir():
        if any(expert is not None for _, _, expert in loras):  # a Hub id: its model_index.json alone is fetched
            _check_lora_experts(args.lora, loras, len(pipeline_index(args.model, args.revision).experts), args.model)
        return  # resolving a Hub id downloads the checkpoint; from_pretrained's own checks come first
    ckpt = resolve(args.model, allow_pickle=args.allow_pickle, revision=args.revision)
    _check_lora_experts(args.lora, loras, len(ckpt.experts), ckpt.variant)
    s, _, _ = check_request(ckpt, ckpt.preset, load_scheduler(ckpt), checkpoint_vae_factors(ckpt), args.prompt,
                           image=args.image, last_image=args.last_image, negative_prompt=args.negative_prompt,
                           height=args.height, width=args.width, num_frames=args.num_frames,
                           num_inference_steps=args.steps, guidance_scale=args.guidance_scale,
                           guidance_scale_2=args.guidance_scale_2, seed=args.seed, fps=args.fps, sampler=args.sampler,
                           timesteps=args.timesteps, flow_shift=args.flow_shift)
    # the step cache against the request's step count and size (steps it names, whether it can skip any, TeaCache's
    # coefficients): checked here, as generate_video checks it, so the mistake fails before the model loads
    resolve_coefficients(check_cache(args.cache), ckpt.variant, ckpt.transformer_config.inner_dim, s.height, s.width,
                         s.num_inference_steps)


def _run_generate(args) -> int:
    """Check the output destination, load the model, make one video, print where it is, the seed and the
    timings."""
    import torch

    from fastwan import VideoGenerator
    from fastwan.options import DiTOptions
    from fastwan.parallel.workers import ParallelGenerator
    from fastwan.pipelines.image import read_image

    _check_output(args)
    for name in ("image", "last_image"):  # read once: an unreadable image fails before the model loads, and a
        if getattr(args, name) is not None:  # pipe (bash's <(...)) is not read a second time, empty
            setattr(args, name, read_image(getattr(args, name), name))
    loras = [_lora_arg(a) for a in args.lora]  # each --lora parsed once
    _check_request(args, loras)
    num_gpus = _num_gpus(args)
    device = args.device if args.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, _dtype_name(args, device))
    gen = VideoGenerator.from_pretrained(
        args.model, device=device, dtype=dtype, attention_backend=args.attention_backend,
        attention_config=args.attention_config, enable_torch_compile=args.compile,
        cfg_gate_step=args.cfg_gate_step, cfg_mode=args.cfg_mode, vae_tiling=args.vae_tiling,
        vae_chunk_frames=args.vae_chunk_frames, dit_options=DiTOptions(block=args.dit_block), cache=args.cache,
        lora=loras, quantization=args.quantization, max_gpu_memory=args.max_gpu_memory,
        num_gpus=num_gpus, cfg_parallel=args.cfg_parallel, revision=args.revision, allow_pickle=args.allow_pickle,
    )
    quiet = gen.parallel is not None and not gen.parallel.writes  # a launcher's rank other than 0 prints nothing
    if gen.memory_plan is not None and not quiet:
        print(gen.memory_plan.describe())
    try:
        res = gen.generate_video(
            args.prompt, image=args.image, last_image=args.last_image, negative_prompt=args.negative_prompt,
            height=args.height, width=args.width,
            num_frames=args.num_frames, num_inference_steps=args.steps, guidance_scale=args.guidance_scale,
            guidance_scale_2=args.guidance_scale_2, seed=args.seed, fps=args.fps, output_path=args.output,
            overwrite=args.overwrite, return_frames=False, sampler=args.sampler, timesteps=args.timesteps,
            flow_shift=args.flow_shift,
        )
    finally:  # worker processes fastwan started (--sp / --cfg-parallel outside a launcher) end with the run
        if isinstance(gen, ParallelGenerator):
            gen.close()
    if quiet:
        return 0
    t = res.timings
    print(f"video: {res.video_path}")
    print(f"seed: {res.seed}")
    print(f"attention: {res.attention_backend}")
    print("time: text {:.2f}s, denoise {:.2f}s, decode {:.2f}s, total {:.2f}s".format(
        t["text_encoding"], t["denoising"], t["decoding"], t["total"]))
    if res.peak_memory is not None:
        print(f"peak GPU memory: {res.peak_memory / 2**30:.2f} GiB")
    if res.cache is not None:
        print(f"{res.cache['type']} computed steps: " + "; ".join(
            f"{name} {len(steps)}/{res.settings['num_inference_steps']} {steps}"
            for name, steps in res.cache["computed"].items()))
    if res.cache is not None and "calibration" in res.cache:  # JSON per pass: a file for mag_ratios=@FILE
        for name, ratios in res.cache["calibration"].items():
            print(f"magcache calibration ({name}): {json.dumps(ratios)}")
    return 0


def _run_quantize(args) -> int:
    from fastwan.models.wan.export import export_fp8

    print(f"wrote {export_fp8(args.model, args.output, overwrite=args.overwrite, device=args.device)}")
    return 0


def _lora_arg(text: str) -> tuple[str, float, int | None]:
    """'style.safetensors:0.8' -> (path, 0.8, None); a path without a ':SCALE' suffix gets 1.0; a last ':high' /
    ':low' names the Wan2.2 A14B expert (0 / 1) the LoRA goes into (None: every expert). A file whose name holds a
    colon is itself the path; a suffix after an existing file that is not [:SCALE][:high|low] raises naming it."""
    given = text
    if _is_file(text):  # an existing file is the path, whatever its name ends with
        return text, 1.0, None
    head, sep, last = text.rpartition(":")
    expert = None
    if sep and head and last.lower() in LORA_EXPERTS:
        text, expert = head, LORA_EXPERTS[last.lower()]
    path, sep, scale = text.rpartition(":")
    if not (sep and path) or _is_file(text):
        parsed = (text, 1.0, expert)
    else:
        try:
            parsed = (path, float(scale), expert)
        except ValueError:
            if _is_file(path):
                raise InvalidArgument(f"--lora {given!r}: the scale {scale!r} after {path!r} is not a number; write "
                                      "PATH:SCALE with a number, e.g. style.safetensors:0.8.") from None
            parsed = (text, 1.0, expert)
    if not _is_file(parsed[0]):
        _check_lora_suffix(given)
    return parsed


def _is_file(path: str) -> bool:
    return bool(path) and Path(path).expanduser().is_file()


def _check_lora_suffix(given: str) -> None:
    """--lora GIVEN names no file as parsed: when a part of it before a colon is an existing file, what follows is a
    malformed suffix (e.g. 'style.safetensors:0.5:mid'), reported as such rather than as a missing file."""
    parts = given.split(":")
    for i in range(len(parts) - 1, 0, -1):  # the longest file first
        prefix = ":".join(parts[:i])
        if _is_file(prefix):
            raise InvalidArgument(
                f"--lora {given!r}: {prefix!r} is a file, but the suffix {':' + ':'.join(parts[i:])!r} after it is "
                "not :SCALE, :high, :low or :SCALE:high / :SCALE:low; write PATH[:SCALE][:high|low], e.g. "
                "style.safetensors:0.8 or style.safetensors:0.8:low.")


def _check_lora_experts(lora_args: list[str], loras: list[tuple[str, float, int | None]], experts: int,
                        model: str) -> None:
    """':high' / ':low' picks one expert of a two-expert (Wan2.2 A14B) checkpoint: on a one-DiT checkpoint it
    names nothing, so it is refused (':high' would otherwise merge silently and ':low' fail by index).
    ``experts``: the checkpoint's DiT count; ``model``: what the message calls the checkpoint."""
    if experts > 1:
        return
    for text, (_, _, expert) in zip(lora_args, loras):
        if expert is not None:
            suffix = text.rpartition(":")[2]
            raise InvalidArgument(
                f"--lora {text!r}: ':{suffix}' merges a LoRA into one expert of a Wan2.2 A14B checkpoint (high or "
                f"low noise), but this checkpoint ({model}) has one DiT; drop ':{suffix}' to merge it into "
                "that DiT.")


def _leave_job() -> None:
    """Destroy the process group a ``--sp``/``--cfg-parallel`` run joined (nothing when none is up)."""
    if "torch" in sys.modules:  # the process group exists only once torch is imported
        from fastwan.parallel.launch import leave

        leave()


def _run_env(argv: list[str]) -> int:
    """``fastwan env ...`` (:mod:`fastwan.envinfo`)."""
    from fastwan.envinfo import main as env_main

    return env_main(argv)


def report_user_errors(run: Callable[[], int]) -> int:
    """``run()``'s exit code, with a user error (:data:`USER_ERRORS`) printed as one line on stderr and exit code 2
    (under a launcher, naming the rank). The examples' scripts end with it."""
    try:
        return run()
    except USER_ERRORS as exc:
        try:
            launched = envs.torchrun_env()
        except USER_ERRORS:  # a bad launcher variable is reported by the run itself when it matters
            launched = None
        rank = f"rank {launched[0]}: " if launched is not None and launched[2] > 1 else ""  # which process said it
        print(f"fastwan: error: {rank}{one_line(exc)}", file=sys.stderr)
        return USER_ERROR_EXIT


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "env":
        return report_user_errors(lambda: _run_env(argv[1:]))
    parser = Parser(prog="fastwan", description="Fast Wan2.1/Wan2.2 text-to-video.")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _quantize_parser(sub)
    sub.add_parser("env", help="device, versions and attention backends available here")
    args = parser.parse_args(argv)
    if args.command == "generate":
        try:
            return report_user_errors(lambda: _run_generate(args))
        finally:  # under torchrun this process is a rank: its process group ends here, not at interpreter exit
            _leave_job()
    if args.command == "quantize":
        return report_user_errors(lambda: _run_quantize(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
