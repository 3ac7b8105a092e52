"""The ``fastwan`` command: ``fastwan generate ...``, ``fastwan quantize ...``, ``fastwan serve ...``
(:mod:`fastwan.serve`) and ``fastwan env``.

Errors: a user error (an exception in :data:`USER_ERRORS`) prints one line, ``fastwan: error: <message>`` (a
multi-line message joined with '; ' by :func:`fastwan.errors.one_line`), on stderr and exits 2; Ctrl-C prints
``fastwan: interrupted`` and exits 130, leaving no partial output; any other exception is a bug and propagates with
its traceback. A run prints fastwan's own lines only: third-party progress bars are off (:mod:`fastwan.quiet`).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

from fastwan import envs
from fastwan.errors import USER_ERROR_EXIT, InvalidArgument, OneLineParser, UserError, one_line, report_interrupt

# The exceptions reported as one line (exit 2): fastwan's user errors. Every other exception is a bug.
USER_ERRORS: tuple[type[Exception], ...] = (UserError,)
LORA_EXPERTS = {"high": 0, "low": 1}  # --lora PATH:...:high|low -> the Wan2.2 A14B expert it goes into


class Parser(OneLineParser):
    """The fastwan command's parser (its subcommands' too, and the examples' scripts'): errors are one line
    starting with 'fastwan: error:', exit code 2."""

    label = "fastwan"


def _generate_parser(sub) -> None:
    """``fastwan generate``: one flag per field of the request and the load options that has one (their help is
    the fields'), plus the launch flag --sp and the repeatable --lora."""
    from fastwan.fields import add_flags
    from fastwan.pipelines.load_options import LoadOptions
    from fastwan.pipelines.params import GenerationRequest

    p = sub.add_parser("generate", help="make a video from a text prompt (and an image)")
    add_flags(p, GenerationRequest)
    add_flags(p, LoadOptions)
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE][:high|low]",
                   help="merge a LoRA (.safetensors) into the DiT, with an optional strength; ':high' / ':low' "
                        "merges it into one Wan2.2 A14B expert only (high or low noise); repeatable")
    p.add_argument("--stream", action="store_true",
                   help="causal checkpoints (Self-Forcing, CausVid): write the mp4 as it is made, a fragmented mp4 "
                        "that plays while it grows, and print each chunk as it is ready")
    p.add_argument("--sp", type=_positive_int, default=None, metavar="N",
                   help="sequence-parallel degree: N processes (GPUs) split each pass's tokens (Ulysses); under "
                        "torchrun --nproc_per_node must equal N (x2 with --cfg-parallel), else fastwan starts them")


def _quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="write a copy of a Wan checkpoint with FP8 DiT weights")
    p.add_argument("--model", required=True, help="Hub id, Diffusers-format folder, or a tiny model name")
    p.add_argument("--output", required=True, help="the new checkpoint folder (other components are linked)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an output folder a former fastwan quantize wrote (no other folder is replaced)")
    p.add_argument("--device", default=None, help="where to quantize (default: cuda if available)")


def _serve_parser(sub) -> None:
    from fastwan.serve.server import add_parser

    add_parser(sub)


def _run_serve(args) -> int:
    """``fastwan serve``: a user error's ``name=`` is written as its flag."""
    from fastwan.fields import cli_text
    from fastwan.pipelines.load_options import LoadOptions
    from fastwan.serve.server import run

    try:
        return run(args)
    except UserError as exc:
        exc.args = (cli_text(str(exc), LoadOptions),)
        raise


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


def _request(args):
    """The command line's GenerationRequest (its images read, its output destination checked: a path that cannot be
    written, or an existing file without --overwrite, fails before anything loads)."""
    from fastwan.fields import flag_values
    from fastwan.pipelines import output
    from fastwan.pipelines.image import read_image
    from fastwan.pipelines.params import GenerationRequest

    fields = flag_values(args, GenerationRequest)
    for name in ("image", "last_image"):  # read once: an unreadable image fails before the model loads, and a
        if fields.get(name) is not None:  # pipe (bash's <(...)) is not read a second time, empty
            fields[name] = read_image(fields[name], name)
    request = GenerationRequest(**fields, return_frames=False)
    output.prepare_output(output.check_output_path(request.output_path, request.overwrite))
    return request


def _resolve_early(args, request, options):
    """``request`` resolved from the checkpoint's files before any weight loads (local folders and tiny models; a
    Hub id would be downloaded first, so its request is resolved once the generator has it), or None: a size, step
    count, guidance, sampler or step-cache mistake fails in seconds, and the generator does not check the resolved
    request again."""
    from fastwan.checkpoint.causal_files import causal_checkpoint
    from fastwan.checkpoint.resolver import pipeline_index, resolve
    from fastwan.checkpoint.tiny import TINY_IDS

    loras, model = options.lora, options.model
    if model not in TINY_IDS and not Path(model).expanduser().is_dir():
        if any(expert is not None for _, _, expert in loras):  # a Hub id: its model_index.json alone is fetched
            _check_lora_experts(args.lora, loras, len(pipeline_index(model, options.revision).experts), model)
        return None
    ckpt = causal_checkpoint(resolve(model, allow_pickle=options.allow_pickle, revision=options.revision), options)
    _check_lora_experts(args.lora, loras, len(ckpt.experts), ckpt.variant)
    return _resolve(args, ckpt, request, options)


def _resolve(args, ckpt, request, options):
    """``request`` resolved from ``ckpt``'s files (its scheduler config and VAE factors; no weight loaded); --stream
    needs a causal checkpoint."""
    from fastwan.pipelines.rules import CheckpointRules

    if args.stream and ckpt.causal is None:
        raise InvalidArgument(f"--stream needs a causal checkpoint (Self-Forcing, CausVid: a WanCausalDMDPipeline "
                              f"folder, or --causal-weights FILE); {ckpt.root} samples the whole video at once. "
                              "Drop --stream, or load a causal checkpoint.")
    return CheckpointRules.of(ckpt, options.cache).resolve(request)


def _run_generate(args) -> int:
    """Check the request and the output destination, load the model, make one video, print what it makes before
    it starts, then where it is, the seed and the timings. A user error's ``name=`` is written as its flag."""
    from fastwan.fields import cli_text
    from fastwan.pipelines.load_options import LoadOptions
    from fastwan.pipelines.params import GenerationRequest

    try:
        return _generate(args)
    except UserError as exc:
        exc.args = (cli_text(str(exc), GenerationRequest, LoadOptions),)
        raise


def _generate(args) -> int:
    from fastwan import VideoGenerator
    from fastwan.fields import flag_values
    from fastwan.parallel.workers import ParallelGenerator
    from fastwan.pipelines.load_options import LoadOptions

    request = _request(args)
    loras = [_lora_arg(a) for a in args.lora]  # each --lora parsed once
    options = LoadOptions(**flag_values(args, LoadOptions), lora=loras, num_gpus=_num_gpus(args))
    resolved = _resolve_early(args, request, options)
    if resolved is not None and resolved.chords is not None:  # CHORDS's cores over the processes, before loading
        from fastwan.parallel.chords_ranks import check_layout

        check_layout(len(resolved.chords), options.num_gpus, options.cfg_parallel)
    gen = VideoGenerator.load(options)
    quiet = gen.parallel is not None and not gen.parallel.writes  # a launcher's rank other than 0 prints nothing
    if gen.memory_plan is not None and not quiet:
        print(gen.memory_plan.describe())
    try:
        if resolved is None:  # a Hub model: its files are here now
            resolved = _resolve(args, gen.checkpoint, request, options)
        if not quiet:
            print(f"making: {resolved.describe()}", flush=True)
        if args.stream:
            return _stream(gen, resolved)
        res = gen.generate(resolved)
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


def _stream(gen, resolved) -> int:
    """--stream: the video written as it is made (:class:`~fastwan.pipelines.stream_output.VideoStreamWriter`), a
    line per chunk as it is ready; the file is removed if the stream does not finish."""
    from fastwan.pipelines import output
    from fastwan.pipelines.stream_output import VideoStreamWriter

    r, s = resolved.request, resolved.settings
    stream = gen.stream_video(r.prompt, height=s.height, width=s.width, num_frames=s.num_frames, seed=r.seed,
                              fps=s.fps)
    target = output.check_output_path(r.output_path, r.overwrite)
    name = output.automatic_name(r.prompt, stream.seed,
                                 gen._identity(resolved.negative_prompt, {**s.__dict__, "stream": True}, None))
    with stream, VideoStreamWriter(target, name, s.fps) as writer:
        print(f"streaming to: {writer.path}", flush=True)
        for chunk in stream:
            writer.append(chunk.frames)
            t = chunk.timings
            print(f"chunk {chunk.index + 1}: frames {chunk.first_frame}-{chunk.first_frame + len(chunk.frames) - 1} "
                  f"ready at {t['elapsed']:.2f}s (dit {t['dit']:.2f}s, kv write {t['kv_write']:.2f}s, decode "
                  f"{t['decode']:.2f}s)", flush=True)
    print(f"video: {writer.path}")
    print(f"seed: {stream.seed}")
    print(f"attention: {gen.attention.describe(gen.device)}")
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
    if not math.isfinite(parsed[1]):
        raise InvalidArgument(f"--lora {given!r}: the scale {scale} must be a finite number (1.0 as trained, 0.5 for "
                              "half strength), e.g. style.safetensors:0.8.")
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


def _rank() -> str:
    """'rank R: ' in a process a launcher started as one of several ranks (which process says it), else ''."""
    try:
        launched = envs.torchrun_env()
    except USER_ERRORS:  # a bad launcher variable is reported by the run itself when it matters
        launched = None
    return f"rank {launched[0]}: " if launched is not None and launched[2] > 1 else ""


def report_user_errors(run: Callable[[], int]) -> int:
    """``run()``'s exit code, with a user error (:data:`USER_ERRORS`) printed as one line on stderr and exit code 2,
    and Ctrl-C as the one line 'fastwan: interrupted' and exit code 130 (under a launcher, naming the rank). The
    examples' scripts end with it."""
    try:
        return run()
    except USER_ERRORS as exc:
        print(f"fastwan: error: {_rank()}{one_line(exc)}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        pass  # said below: once the run's frames are gone, its progress bars have cleared their line
    return report_interrupt(_rank())


def _quietly(run: Callable[[], int]) -> int:
    """``run()`` with third-party progress bars and notices off (:mod:`fastwan.quiet`)."""
    from fastwan.quiet import quiet_libraries

    quiet_libraries()
    return run()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "env":
        return report_user_errors(lambda: _run_env(argv[1:]))
    parser = Parser(prog="fastwan", description="Fast Wan2.1/Wan2.2 text-to-video.")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _quantize_parser(sub)
    _serve_parser(sub)
    sub.add_parser("env", help="device, versions and attention backends available here")
    args = parser.parse_args(argv)
    if args.command == "generate":
        try:
            return report_user_errors(lambda: _quietly(lambda: _run_generate(args)))
        finally:  # under torchrun this process is a rank: its process group ends here, not at interpreter exit
            _leave_job()
    if args.command == "quantize":
        return report_user_errors(lambda: _quietly(lambda: _run_quantize(args)))
    if args.command == "serve":
        return report_user_errors(lambda: _quietly(lambda: _run_serve(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
