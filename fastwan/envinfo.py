"""`fastwan env`: what this machine can run — device, library versions, and every attention backend with
whether it is available here, its version and kernel, and why not; also the fastwan environment variables that are
set, the error of each that does not parse, and the backend they request with whether it can run here.

Usage: ``fastwan env [--json] [--device cuda:0] [--dtype bf16] [--head-dim 128]``.
"""
from __future__ import annotations

import json
import logging
import platform
import sys
from typing import Any

import torch

from fastwan import envs
from fastwan.errors import InvalidArgument, OneLineParser, UserError, one_line

PACKAGES = (
    "flash-attn",
    "flash-attn-4",
    "flash_attn_3",
    "sageattention",
    "triton",
    "flashinfer-python",
    "nvidia-cutlass-dsl",
    "diffusers",
    "transformers",
)

DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}


def parse_device(text: str, option: str = "--device") -> torch.device:
    """``text`` as a torch device; :class:`InvalidArgument` when it is none, or names a CUDA index this machine
    lacks (CUDA itself missing is left to the caller: ``fastwan env`` reports it)."""
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise InvalidArgument(f"{text!r} (from {option}) is not a torch device; use e.g. 'cuda', 'cuda:1' or 'cpu'."
                              ) from None
    if device.type == "cuda" and device.index is not None and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if device.index >= count:
            raise InvalidArgument(f"{text!r} (from {option}) names a CUDA device this machine lacks: it has {count}, "
                                  f"cuda:0 to cuda:{count - 1}.")
    return device


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}") from None


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def device_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """Name, compute capability, memory and SM count of ``device`` (a CPU gets its platform name)."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda":
        return {"device": str(device), "name": platform.processor() or platform.machine(), "type": device.type}
    if not torch.cuda.is_available():
        return {"device": str(device), "name": None, "type": "cuda", "error": "CUDA is not available"}
    p = torch.cuda.get_device_properties(device)
    return {
        "device": str(device),
        "type": "cuda",
        "name": p.name,
        "compute_capability": f"sm{p.major}{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1),
        "sm_count": p.multi_processor_count,
    }


def software_versions() -> dict[str, Any]:
    from fastwan import __version__
    from fastwan.attention.backends.packages import dist_version

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "fastwan": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "triton": dist_version("triton", "pytorch-triton"),
        "packages": {name: dist_version(name) for name in PACKAGES},
    }


def backend_rows(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[dict[str, Any]]:
    """One row per backend variant: available here for (device, dtype, head_dim)? version, kernel, reasons."""
    from fastwan.attention.variants import backend_specs

    rows = []
    for spec in backend_specs(variants=True):
        row: dict[str, Any] = {"backend": spec.label, "name": spec.name, "config": spec.config}
        try:
            backend = spec.create()
            reasons = backend.reasons(device=device, dtype=dtype, head_dim=head_dim)
            row.update(
                available=not reasons,
                version=backend.version_info(device),
                kernel=backend.kernel_name(device),
                sparse=bool(getattr(backend, "sparse", False)),
                reasons=reasons,
                unverified=None if reasons else backend.unverified(device, head_dim),
            )
        except Exception as exc:  # a backend that cannot be created is reported with its error, not raised
            row.update(available=False, version=None, kernel=None, sparse=None, unverified=None,
                       reasons=[f"cannot create: {type(exc).__name__}: {exc}"])
        rows.append(row)
    return rows


def _quiet_attention_log():
    """Keep the backend choice's info line out of the report (the report already says it)."""
    log = logging.getLogger("fastwan.attention")
    level = log.level
    log.setLevel(logging.WARNING)
    return lambda: log.setLevel(level)


def auto_choice(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    from fastwan.attention.registry import auto_backend

    restore = _quiet_attention_log()
    try:
        b = auto_backend(device=device, dtype=dtype, head_dim=head_dim)
        return f"{b.name} ({b.kernel_name(device)})"
    except Exception as exc:
        return f"none: {exc}"
    finally:
        restore()


def requested_choice(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """The backend the environment asks for (FASTVIDEO_ATTENTION_BACKEND, FASTVIDEO_NVFP4_FA4) and whether it can
    run here, or None when it asks for none (a variable that does not parse is in :func:`envs.problems`)."""
    from fastwan.attention.registry import requested_backend, resolve_backend

    try:
        choice, source = requested_backend()
    except UserError:
        return None
    if choice is None:
        return None
    restore = _quiet_attention_log()
    try:
        b = resolve_backend(None, device=device, dtype=dtype, head_dim=head_dim)
        return f"{b.name} ({b.kernel_name(device)}), requested by {source}"
    except UserError as exc:
        return one_line(exc)
    finally:
        restore()


def collect(device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128):
    device = device or default_device()
    return {
        "device": device_info(device),
        "software": software_versions(),
        "env": envs.known_variables(),
        "env_problems": envs.problems(),
        "requested_backend": requested_choice(device, dtype, head_dim),
        "problem": {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "head_dim": head_dim},
        "auto_backend": auto_choice(device, dtype, head_dim),
        "backends": backend_rows(device, dtype, head_dim),
    }


def render(info: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    d, sw = info["device"], info["software"]
    dev = d.get("name") or d.get("error")
    if d.get("compute_capability"):
        dev += f" ({d['compute_capability']}, {d['memory_gib']} GiB, {d['sm_count']} SMs)"
    console.print(f"[bold]Device[/]  {escape(d['device'])}: {escape(str(dev))}")
    console.print(
        f"[bold]Software[/]  fastwan {sw['fastwan']}, Python {sw['python']}, torch {sw['torch']}, "
        f"CUDA {sw['cuda']}, cuDNN {sw['cudnn']}, Triton {sw['triton']}"
    )
    pk = ", ".join(f"{k} {v}" for k, v in sw["packages"].items() if v) or "none"
    console.print(f"[bold]Packages[/]  {escape(pk)}")
    if info["env"]:
        console.print("[bold]Environment[/]  " + escape(", ".join(f"{k}={v}" for k, v in info["env"].items())))
    for problem in info["env_problems"]:
        console.print(f"[bold red]Environment error[/]  {escape(one_line(problem))}")
    p = info["problem"]
    table = Table(title=f"Attention backends on {p['device']} ({p['dtype']}, head dim {p['head_dim']})")
    for col in ("backend", "available", "version", "kernel", "why not / unverified"):
        table.add_column(col, overflow="fold")
    for r in info["backends"]:
        if not r["available"]:
            avail = Text("no", style="red")
        elif r.get("unverified"):
            avail = Text("yes, unverified", style="yellow")
        else:
            avail = Text("yes", style="green")
        table.add_row(
            Text(r["backend"]),
            avail,
            Text(r["version"] or "-"),
            Text(r["kernel"] or "-"),
            Text("\n".join(r["reasons"]) or r.get("unverified") or "-"),
        )
    console.print(table)
    console.print(f"[bold]Automatic choice[/]  {escape(info['auto_backend'])}")
    if info["requested_backend"]:
        console.print(f"[bold]Requested[/]  {escape(info['requested_backend'])}")


def build_parser() -> OneLineParser:
    """``fastwan env``'s arguments (also read by :mod:`fastwan.cli_reference`)."""
    parser = OneLineParser(prog="fastwan env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--device", default=None, help="device to check (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="bf16", help="dtype to check backends for (default bf16)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim to check backends for (default 128)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        dtype = parse_dtype(args.dtype)
    except ValueError as exc:
        parser.error(str(exc))
    if args.head_dim < 1:
        parser.error(f"--head-dim {args.head_dim} must be a positive integer (Wan's is 128)")
    device = parse_device(args.device) if args.device is not None else None  # '' is refused, not the default
    info = collect(device, dtype, args.head_dim)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        render(info)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except UserError as exc:
        print(f"fastwan: error: {one_line(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
