"""``fastwan quantize``: a Wan pipeline folder whose DiT(s) hold FP8 weights, loadable by ``from_pretrained``.

The new folder has the source's ``model_index.json``, each DiT expert written in FP8
(:func:`fastwan.models.wan.quantize.save_fp8_transformer`) and every other component (text encoder, VAE, ...) as
a symbolic link to the source's folder (absolute), so only the DiT's bytes are written. The folder is built beside
the destination under a temporary name (with the umask's modes, :mod:`fastwan.files`) and moved into place when
complete: a failure leaves no partial folder, an existing destination is replaced only with ``overwrite`` and only
when it is a pipeline folder (it holds a ``model_index.json``), and never when it is or holds the source checkpoint
(the new folder links there).
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from fastwan.errors import InvalidArgument, OutputExistsError, OutputPathError
from fastwan.files import new_temp_folder

logger = logging.getLogger("fastwan")


def _check_destination(output: Path, overwrite: bool) -> None:
    """Before any work: ``output`` is a new, empty or (with ``overwrite``) checkpoint folder in a writable folder."""
    if output.exists() and not output.is_dir():
        raise OutputPathError(f"output={str(output)!r} is a file; the FP8 checkpoint is a folder: give a folder "
                              "path.")
    if output.exists() and any(output.iterdir()):
        if not overwrite:
            raise OutputExistsError(f"output={str(output)!r} exists and is not empty; choose a new folder or pass "
                                    "overwrite (--overwrite) to replace it.")
        if not (output / "model_index.json").is_file():
            raise OutputPathError(f"output={str(output)!r} is a folder that holds no model_index.json: overwrite "
                                  "replaces only a pipeline checkpoint folder (a former export), never other "
                                  "files; choose a new or empty folder.")
    parent = output.parent
    if not parent.is_dir():
        raise OutputPathError(f"the parent folder of output={str(output)!r} does not exist or is not a folder; "
                              "create it first.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"the parent folder of output={str(output)!r} is not writable; choose a folder you "
                              "can write to.")


def _check_apart(output: Path, sources: list[Path]) -> None:
    """``output`` is none of ``sources`` (the source checkpoint's folder and the component folders the export
    links to) and holds none of them: replacing it would delete what the new folder is made from."""
    out = output.resolve()
    for src in sources:
        real = src.resolve()
        if real == out or out in real.parents:
            raise OutputPathError(f"output={str(output)!r} is or holds {real}, part of the source checkpoint; "
                                  "replacing it would delete the weights the FP8 folder is made from and links "
                                  "to: choose a folder outside the source checkpoint.")


def _device(device) -> torch.device:
    """``device`` as the torch device to quantize on: None -> CUDA if available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidArgument(f"device={device!r} is not a torch device; quantize on 'cpu' or 'cuda' "
                              "('cuda:1', ...).") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"device={device!r}: the FP8 export quantizes on 'cpu' or 'cuda'; use one of them.")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dev.type == "cuda" and (dev.index or 0) >= count:
        raise InvalidArgument(f"device={device!r} is not available here ({count} CUDA devices); use "
                              f"{'a lower index' if count else 'device=cpu'}.")
    return dev


def _remove(path: Path) -> None:
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)


def export_fp8(model: str | Path, output: str | Path, *, overwrite: bool = False,
               device: str | torch.device | None = None, allow_pickle: bool = False) -> Path:
    """Write ``model`` (a Hub id, folder or tiny name, as ``from_pretrained`` takes it) to the folder ``output``
    (``~`` expanded) with FP8 DiT weights, quantizing on ``device`` (default: CUDA if available, else the CPU)
    -> the folder. Every check (the destination, the device, the checkpoint) runs before any weight is read."""
    from fastwan.models import load_transformer
    from fastwan.models.wan.quantize import save_fp8_transformer
    from fastwan.pipelines.checkpoint import resolve

    output = Path(os.path.abspath(Path(output).expanduser()))
    if isinstance(model, (str, Path)) and Path(model).expanduser().is_dir():  # a local source: before all else
        _check_apart(output, [Path(model).expanduser()])
    _check_destination(output, overwrite)
    device = _device(device)
    ckpt = resolve(model, allow_pickle=allow_pickle)
    components = [k for k, v in ckpt.index.items() if not k.startswith("_") and isinstance(v, list)]
    _check_apart(output, [ckpt.root, *(ckpt.folder(n) for n in components if ckpt.folder(n).exists())])
    try:
        tmp = new_temp_folder(output.parent, f".{output.name}.", ".tmp")
    except OSError as exc:
        raise OutputPathError(f"cannot write a folder beside output={str(output)!r} ({exc.strerror}); choose a "
                              "folder you can write to.") from None
    old = tmp.with_name(tmp.name[: -len(".tmp")] + ".old")  # as unique as tmp's name
    try:
        shutil.copyfile(ckpt.root / "model_index.json", tmp / "model_index.json")
        for name in components:
            src = ckpt.folder(name)
            if name in ckpt.experts:
                # fp32 keeps the unquantized tensors (biases, embedders, norms) at the file's precision
                dit = load_transformer(src, dtype=torch.float32, device="cpu", compute_device=device,
                                       quantization="fp8", allow_pickle=allow_pickle)
                save_fp8_transformer(dit, src / "config.json", tmp / name)
                del dit
            elif src.exists():
                (tmp / name).symlink_to(src.resolve(), target_is_directory=True)
        if output.exists() or output.is_symlink():
            output.rename(old)
            try:
                tmp.rename(output)
            except BaseException:
                old.rename(output)  # the user's folder back where it was
                raise
        else:
            tmp.rename(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old.exists() or old.is_symlink():
        _remove(old)
    logger.info("wrote %s: %s in FP8, the other components linked to %s", output, ", ".join(ckpt.experts),
                ckpt.root)
    return output
