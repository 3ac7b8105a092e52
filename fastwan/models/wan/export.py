"""``fastwan quantize``: a Wan pipeline folder whose DiT(s) hold FP8 weights, loadable by ``from_pretrained``.

The new folder has the source's ``model_index.json``, each DiT expert written in FP8
(:func:`fastwan.models.wan.quantize.save_fp8_transformer`) and every other component (text encoder, VAE, ...) as
a symbolic link to the source's folder (absolute), so only the DiT's bytes are written. The folder is built beside
the destination under a temporary name (with the umask's modes, :mod:`fastwan.checkpoint.files`) and moved into place
when complete: a failure leaves no partial folder.

Destination rules, checked before any weight is read (the existing folder again just before it is replaced):

- ``output`` is a non-empty path (``~`` expanded), not a symbolic link, neither the current folder nor one that
  holds it, and neither is nor holds the source checkpoint or a component folder the export links to.
- A new path or an empty folder is written. An existing folder that holds anything is replaced only with
  ``overwrite``, and only when it is a former export (:func:`_export_contents`): a ``model_index.json``, FP8
  transformer folders holding just the ``config.json`` and weights file :func:`save_fp8_transformer` writes (both
  marked ``fastwan_quantization``), and links named after its components -- nothing else.
- Replacing deletes only the files and links that rule listed, and folders only once empty, so no file fastwan did
  not write is ever deleted (one that appears meanwhile is left, with a warning).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from fastwan.errors import InvalidArgument, InvalidArgumentType, OutputExistsError, OutputPathError
from fastwan.checkpoint.files import new_temp_folder

logger = logging.getLogger("fastwan")

INDEX_NAME = "model_index.json"


def _output_path(output) -> Path:
    """``output`` as an absolute path (``~`` expanded); a value that names no folder raises."""
    text = os.fspath(output) if isinstance(output, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise InvalidArgumentType(f"output={output!r} must be a str or a path: the new checkpoint folder.")
    if not text.strip():
        raise InvalidArgument(f"output={output!r} is empty; pass the new checkpoint folder (CLI: --output), e.g. "
                              "'wan-fp8'.")
    if "\0" in text:
        raise InvalidArgument(f"output={text!r} contains a NUL character, which no file name may hold; remove it.")
    try:
        path = Path(text).expanduser()
    except RuntimeError as exc:  # no home folder known for '~' or '~user'
        raise InvalidArgument(f"output={text!r}: '~' cannot be expanded ({exc}); pass the full path.") from None
    return Path(os.path.abspath(path))


def _check_not_working_folder(output: Path) -> None:
    """``output`` is neither the current folder nor one that holds it (the export replaces its folder whole)."""
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the current folder was removed: nothing to protect
        return
    out = output.resolve()
    if out == cwd or out in cwd.parents:
        what = "the current folder" if out == cwd else f"a folder that holds the current folder ({cwd})"
        raise OutputPathError(f"output={str(output)!r} is {what}; the export replaces its output folder whole, so "
                              "it is never the folder you work in or one above it: give a new folder, e.g. "
                              f"{str(cwd / 'wan-fp8')!r}.")


def _safetensors_metadata(path: Path) -> dict:
    """The ``__metadata__`` of a safetensors file's header ({} when it has none or is no safetensors file)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return f.metadata() or {}
    except (OSError, SafetensorError):
        return {}


def _fp8_folder_problem(folder: Path) -> str | None:
    """None when ``folder`` holds exactly what :func:`save_fp8_transformer` writes, else what differs."""
    from fastwan.models.wan.quantize import CONFIG_KEY, WEIGHTS_NAME

    if not folder.is_dir():
        return f"{folder.name!r} is a file, where an export holds a link or an FP8 transformer folder"
    names = sorted(p.name for p in folder.iterdir())
    if names != sorted(["config.json", WEIGHTS_NAME]):
        return (f"{folder.name}/ holds {names}, where an export's FP8 transformer folder holds only config.json "
                f"and {WEIGHTS_NAME}")
    config, weights = folder / "config.json", folder / WEIGHTS_NAME
    try:
        raw = json.loads(config.read_text()) if config.is_file() and not config.is_symlink() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raw = None
    if not (isinstance(raw, dict) and isinstance(raw.get(CONFIG_KEY), dict) and raw[CONFIG_KEY].get("method") == "fp8"):
        return f"{folder.name}/config.json has no {CONFIG_KEY!r} entry of an FP8 export"
    if weights.is_symlink() or _safetensors_metadata(weights).get(CONFIG_KEY) != "fp8":
        return f"{folder.name}/{WEIGHTS_NAME} is not an FP8 weights file fastwan wrote"
    return None


def _export_contents(folder: str | Path) -> tuple[list[Path], str | None]:
    """``([paths relative to folder], None)`` when ``folder`` is a former FP8 export (the module's rule): what
    replacing it deletes, each folder after what it holds; else ``([], why it is not)``."""
    folder = Path(folder)
    index_file = folder / INDEX_NAME
    try:
        index = json.loads(index_file.read_text()) if not index_file.is_symlink() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        index = None
    if not isinstance(index, dict):
        return [], f"it holds no pipeline's {INDEX_NAME}"
    components = {k for k, v in index.items() if not k.startswith("_") and isinstance(v, list)}
    listed, experts = [Path(INDEX_NAME)], 0
    for entry in sorted(folder.iterdir()):
        if entry.name == INDEX_NAME:
            continue
        if entry.name not in components:
            return [], f"it holds {entry.name!r}, which is no component of its {INDEX_NAME}"
        if entry.is_symlink():
            listed.append(Path(entry.name))
            continue
        problem = _fp8_folder_problem(entry)
        if problem is not None:
            return [], problem
        listed += [Path(entry.name, p.name) for p in sorted(entry.iterdir())] + [Path(entry.name)]
        experts += 1
    if not experts:
        return [], "it holds no FP8 transformer folder"
    return listed, None


def _replaceable(output: Path, overwrite: bool) -> list[Path] | None:
    """What writing ``output`` removes: None (a new path), [] (an empty folder) or a former export's contents
    (with ``overwrite``); anything else raises naming the folder, the rule and the fix."""
    if output.is_symlink():
        raise OutputPathError(f"output={str(output)!r} is a symbolic link (to {os.readlink(output)}); the export "
                              "writes a folder of its own and replaces no link: give the folder's real path or "
                              "another path.")
    if not output.exists():
        return None
    if not output.is_dir():
        raise OutputPathError(f"output={str(output)!r} is a file; the FP8 checkpoint is a folder: give a folder "
                              "path.")
    if not any(output.iterdir()):
        return []
    if not overwrite:
        raise OutputExistsError(f"output={str(output)!r} exists and is not empty; choose a new folder or pass "
                                "overwrite (--overwrite) to replace a former export.")
    listed, why = _export_contents(output)
    if why is not None:
        raise OutputPathError(f"output={str(output)!r} is not a folder fastwan quantize wrote ({why}); overwrite "
                              "(--overwrite) replaces only a former FP8 export -- its model_index.json, FP8 "
                              "transformer folders and links to the source's components, nothing else -- so that "
                              "no other file is deleted: choose another output folder, or remove this one "
                              "yourself.")
    return listed


def _check_destination(output: Path, overwrite: bool) -> None:
    """Before any work: ``output`` may be written (the module's destination rules) in a writable folder."""
    _check_not_working_folder(output)
    _replaceable(output, overwrite)
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


def _remove_listed(folder: Path, listed: list[Path]) -> None:
    """Delete ``listed`` (paths relative to ``folder``, each folder after what it holds), then ``folder``: files
    and links are unlinked, folders removed only when empty. Anything else in it is left, with a warning."""
    left = None
    for path in [*(folder / rel for rel in listed), folder]:
        try:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()
        except OSError as exc:
            left = exc
    if left is not None:
        logger.warning("left %s, the folder the export replaced: it holds files fastwan did not write (%s); "
                       "remove it yourself", folder, left.strerror or left)


def export_fp8(model: str | Path, output: str | Path, *, overwrite: bool = False,
               device: str | torch.device | None = None, allow_pickle: bool = False) -> Path:
    """Write ``model`` (a Hub id, folder or tiny name, as ``from_pretrained`` takes it) to the folder ``output``
    (``~`` expanded) with FP8 DiT weights, quantizing on ``device`` (default: CUDA if available, else the CPU)
    -> the folder. ``overwrite`` replaces only a former export (the module's destination rules). Every check
    (the destination, the device, the checkpoint) runs before any weight is read."""
    from fastwan.models import load_transformer
    from fastwan.models.wan.quantize import save_fp8_transformer
    from fastwan.checkpoint.resolver import resolve

    output = _output_path(output)
    if not isinstance(overwrite, bool):
        raise InvalidArgumentType(f"overwrite={overwrite!r} must be True or False.")
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
    park = None  # a new folder the replaced one is moved into before its contents are deleted
    try:
        shutil.copyfile(ckpt.root / INDEX_NAME, tmp / INDEX_NAME)
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
        listed = _replaceable(output, overwrite)  # again: the folder may have changed while the weights were written
        if listed is None:
            tmp.rename(output)
        else:
            park = new_temp_folder(output.parent, f".{output.name}.", ".old")
            output.rename(park / output.name)
            try:
                tmp.rename(output)
            except BaseException:
                (park / output.name).rename(output)  # the replaced folder back where it was
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if park is not None:
            try:
                park.rmdir()  # empty again once the replaced folder is back
            except OSError:
                logger.warning("the folder %s could not be put back: it is %s", output, park / output.name)
        raise
    if park is not None:
        _remove_listed(park, [*(output.name / rel for rel in listed), Path(output.name)])
    logger.info("wrote %s: %s in FP8, the other components linked to %s", output, ", ".join(ckpt.experts),
                ckpt.root)
    return output
