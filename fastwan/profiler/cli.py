"""``python -m fastwan.profiler``: which attention backends can run a Wan self-attention problem, how fast, and
which is fastest. The problem is a token grid (``-i T H W``) or a model preset and a resolution (``--model``)."""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from fastwan.attention.variants import BackendSpec, backend_specs
from fastwan.envinfo import default_device, parse_device, parse_dtype
from fastwan.errors import InvalidArgument, OneLineParser, OutputPathError, UserError, one_line, report_interrupt
from fastwan.checkpoint.safetensors import write_atomically
from fastwan.profiler.problem import MODELS, Problem, model_grid, model_preset
from fastwan.profiler.output import render, report
from fastwan.profiler.runner import plan, run
from fastwan.quiet import quiet_libraries


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="python -m fastwan.profiler",
        description="Time attention backends on Wan self-attention problems (NATTEN-style profiler).",
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("-i", "--input-size", nargs=3, type=int, metavar=("T", "H", "W"), help="token grid")
    src.add_argument("--model", metavar="M",
                     help="derive heads, head dim and grid from a Wan model: a preset (" + ", ".join(MODELS) + "), "
                          "a tiny model name or a Diffusers-format folder (as fastwan generate --model)")
    ap.add_argument("--height", type=int, help="video height in pixels (with --model)")
    ap.add_argument("--width", type=int, help="video width in pixels (with --model)")
    ap.add_argument("--num-frames", type=int, help="video frames, 4k+1 (with --model)")
    ap.add_argument("-b", "--batch", type=int, default=1, help="batch size of the attention inputs (default 1)")
    ap.add_argument("-n", "--heads", type=int, help="attention heads (default: model's, else 12)")
    ap.add_argument("-d", "--head-dim", type=int, help="head dim (default: model's, else 128)")
    ap.add_argument("--dtype", default="bf16", help="bf16 | fp16 | fp32")
    ap.add_argument("--device", help="default: cuda if available, else cpu")
    ap.add_argument("--backend", action="append", help="backend name (repeatable) or 'all' (default: all)")
    ap.add_argument("--warmup", type=int, help="warmup calls (default 3 on GPU, 1 on CPU)")
    ap.add_argument("--iters", type=int, help="timed calls (default 10 on GPU, 3 on CPU)")
    ap.add_argument("--dry-run", action="store_true", help="only say which backends can run and why not")
    ap.add_argument("--optimize", action="store_true", help="also try every kernel variant; report the fastest")
    ap.add_argument("--step-index", type=int, default=None,
                    help="denoising step passed to sparse backends (0-based, below --num-steps; default: the last)")
    ap.add_argument("--num-steps", type=int, default=50,
                    help="denoising steps passed to sparse backends (default 50)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the inputs, an int in [0, 2**64) (default 0)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON (replaces an existing file whole)")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=JSON",
                    help="settings for one backend, e.g. 'SLIDING_TILE_ATTN={\"window\": [5, 3, 3]}' "
                         "(repeatable; a JSON object, or a path to a JSON file)")
    return ap


def _given(value, default):
    """``value`` unless the flag was left out (0 is a value, checked, never a default)."""
    return default if value is None else value


def problem_from_args(args: argparse.Namespace) -> Problem:
    device = parse_device(args.device) if args.device is not None else default_device()  # "" is refused
    dtype = parse_dtype(args.dtype)
    given = {"-b/--batch": args.batch, "-n/--heads": args.heads, "-d/--head-dim": args.head_dim}
    for flag, value in given.items():
        if value is not None and value < 1:
            raise InvalidArgument(f"{flag} {value} must be an int >= 1; drop it for the default.")
    if args.model is not None:
        preset = model_preset(args.model)
        h, w, f = preset.default_size
        grid = model_grid(preset, _given(args.height, h), _given(args.width, w), _given(args.num_frames, f),
                          name=args.model)
        heads, head_dim = _given(args.heads, preset.heads), _given(args.head_dim, preset.head_dim)
    else:
        if any(x is not None for x in (args.height, args.width, args.num_frames)):
            raise InvalidArgument("--height/--width/--num-frames need --model (or give the token grid with -i T H W).")
        if args.input_size is None:
            raise InvalidArgument("give a token grid with -i T H W, or a model preset with --model.")
        grid = tuple(args.input_size)
        if min(grid) < 1:
            raise InvalidArgument(f"-i {' '.join(map(str, grid))}: grid must be positive in each of T, H, W "
                                  "(tokens per axis), e.g. -i 21 30 52.")
        heads, head_dim = _given(args.heads, 12), _given(args.head_dim, 128)
    if not 0 <= args.seed < 2**64:
        raise InvalidArgument(f"--seed {args.seed} must be an int in [0, 2**64) (the inputs' random seed), e.g. 0.")
    if args.step_index is None and args.num_steps >= 1:
        args.step_index = args.num_steps - 1
    if args.num_steps < 1 or args.step_index is None or not 0 <= args.step_index < args.num_steps:
        raise InvalidArgument(
            f"--step-index {args.step_index} and --num-steps {args.num_steps}: need --num-steps >= 1 and "
            "0 <= --step-index < --num-steps (the step sparse backends are timed at).")
    return Problem(args.batch, heads, head_dim, grid, dtype, device)


def parse_configs(items: Sequence[str], specs: Sequence[BackendSpec] = ()) -> dict[str, dict]:
    """['NAME=JSON or path', ...] -> {NAME: config}. Raises InvalidArgument for a bad name or JSON, a backend not among
    ``specs``, a key the backend does not take, or a key one of ``specs`` fixes to another value (its variant)."""
    from fastwan.attention.registry import BACKENDS, create_backend
    from fastwan.attention.sparse import load_attention_config

    out: dict[str, dict] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().upper()
        if not sep or name not in BACKENDS:
            raise InvalidArgument(f"--config {item!r} must be NAME=JSON with NAME one of {', '.join(BACKENDS)}.")
        out[name] = load_attention_config(value, given_by=f"--config {name}")
    selected = {sp.name for sp in specs}
    for name, config in out.items():
        if name not in selected:
            raise InvalidArgument(f"--config {name}=... is for a backend that is not profiled (profiled: "
                                  f"{', '.join(sorted(selected))}); add --backend {name} or drop this --config.")
        try:  # unknown keys and bad values raise here
            create_backend(name, config, source=f"--config {name}")
        except UserError as exc:
            raise InvalidArgument(f"--config {name}: {exc}") from None
        for sp in specs:
            fixed = {k: v for k, v in sp.config.items() if k in config and config[k] != v}
            if sp.name == name and fixed:
                baseline = sp.suffix == "auto"
                why = "the baseline every run times; --optimize times every SDPA kernel" if baseline else \
                    "a variant --optimize adds"
                raise InvalidArgument(
                    f"--config {name} sets {', '.join(f'{k}={config[k]!r}' for k in fixed)}, but the profiled variant "
                    f"{sp.label} fixes {', '.join(f'{k}={v!r}' for k, v in fixed.items())} ({why}); leave "
                    f"{', '.join(fixed)} out of --config{'' if baseline else ', or drop --optimize'}."
                )
    return out


def check_json_path(path: str) -> Path:
    """Where ``--json`` writes, checked before any timing: an existing folder that can be written to."""
    if not path.strip():
        raise InvalidArgument(f"--json {path!r} is empty; give a file path, e.g. 'profile.json', or drop --json.")
    p = Path(path).expanduser()
    folder = p.parent
    if p.is_dir():
        raise OutputPathError(f"--json {path!r} is a folder; give a file path, e.g. "
                              f"{os.path.join(path, 'profile.json')!r}.")
    if not folder.is_dir():
        raise OutputPathError(f"--json {path!r}: the folder {str(folder)!r} does not exist; create it first.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputPathError(f"--json {path!r}: the folder {str(folder)!r} is not writable; choose another path.")
    return p


def write_json(path: Path, data) -> None:
    """Write ``data`` to ``path`` as JSON, whole or not at all."""
    write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2, default=str)))


def main(argv: Sequence[str] | None = None) -> int:
    """The profiler's exit code: 0, 1 when no backend could be timed, 2 on a user error (one line, 'fastwan: error:
    ...', as every fastwan command's), 130 on Ctrl-C (one line, 'fastwan: interrupted')."""
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
        if args.model is not None and args.model not in MODELS:  # a checkpoint's configs (a tiny one written first)
            quiet_libraries()
        return _profile(ap, args)
    except UserError as exc:  # one met after the checks (e.g. writing --json)
        ap.error(one_line(exc))
    except KeyboardInterrupt:
        pass  # said below, once the run's frames (and its progress bars) are gone
    return report_interrupt()


def _profile(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        problem = problem_from_args(args)
        specs = backend_specs(args.backend, variants=args.optimize)
        configs = parse_configs(args.config, specs)
        specs = [BackendSpec(sp.name, {**configs[sp.name], **sp.config}, sp.suffix) if sp.name in configs else sp
                 for sp in specs]
        json_path = check_json_path(args.json) if args.json is not None else None
    except (ValueError, UserError) as exc:
        ap.error(one_line(exc))
    if not args.dry_run and problem.device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {problem.device} cannot be timed: CUDA is not available here; use --device cpu, or "
                 "--dry-run to list why each backend cannot run on it")
    if not args.dry_run and problem.device.type not in ("cpu", "cuda"):
        ap.error(f"--device {problem.device} cannot be timed: the profiled backends run on cpu or cuda only; use "
                 "--device cpu or cuda, or --dry-run to list why each backend cannot run on it")
    on_gpu = problem.device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (3 if on_gpu else 1)
    iters = args.iters if args.iters is not None else (10 if on_gpu else 3)
    if warmup < 0 or iters < 1:
        ap.error(f"--warmup must be >= 0 and --iters >= 1 (got {warmup}, {iters}).")
    if args.dry_run:
        mode, results = "dry-run", plan(problem, specs)[0]
    else:
        mode = "optimize" if args.optimize else "time"
        results = run(problem, specs, warmup=warmup, iters=iters, step_index=args.step_index,
                      num_steps=args.num_steps, seed=args.seed)
    render(problem, results, mode=mode)
    if json_path is not None:
        write_json(json_path, report(problem, results, mode=mode))
    if mode != "dry-run" and not any(r.median_ms for r in results):
        return 1
    return 0
