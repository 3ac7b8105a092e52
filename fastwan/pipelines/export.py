"""``fastwan quantize``: a Wan pipeline folder whose DiT(s) hold FP8 weights, loadable by ``from_pretrained``.

The new folder has the source's ``model_index.json``, each DiT expert written in FP8
(:func:`fastwan.models.wan.quantize.save_fp8_transformer`) and every other component (text encoder, VAE, ...) as
a symbolic link to the source's folder (absolute), so only the DiT's bytes are written. The folder is built beside
the destination under a temporary name and moved into place when complete: a failure leaves no partial folder,
and an existing destination is replaced only with ``overwrite``.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import torch

from fastwan.errors import OutputExistsError, OutputPathError

logger = logging.getLogger("fastwan")


def _check_destination(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise OutputPathError(f"output={str(output)!r} is a file; the FP8 checkpoint is a folder: give a folder "
                              "path.")
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise OutputExistsError(f"output={str(output)!r} exists and is not empty; choose a new folder or pass "
                                "overwrite (--overwrite) to replace it.")
    if not output.parent.exists():
        raise OutputPathError(f"the parent folder of output={str(output)!r} does not exist; create it first.")


def export_fp8(model: str | Path, output: str | Path, *, overwrite: bool = False,
               device: str | torch.device | None = None, allow_pickle: bool = False) -> Path:
    """Write ``model`` (a Hub id, folder or tiny name, as ``from_pretrained`` takes it) to the folder ``output``
    with FP8 DiT weights, quantizing on ``device`` (default: CUDA if available, else the CPU) -> the folder."""
    from fastwan.models import load_transformer
    from fastwan.models.wan.quantize import save_fp8_transformer
    from fastwan.pipelines.checkpoint import resolve

    output = Path(output)
    _check_destination(output, overwrite)
    ckpt = resolve(model, allow_pickle=allow_pickle)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    components = [k for k, v in ckpt.index.items() if not k.startswith("_") and isinstance(v, list)]
    tmp = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp"))
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
        if output.exists():
            old = output.with_name(f".{output.name}.old")
            output.rename(old)
            tmp.rename(output)
            shutil.rmtree(old)
        else:
            tmp.rename(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s: %s in FP8, the other components linked to %s", output, ", ".join(ckpt.experts),
                ckpt.root)
    return output
