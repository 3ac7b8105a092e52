"""Safetensors-only weight loading (single file or shards + index), with checks that fail early and clearly."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_json(path: str | Path, *, missing: str) -> dict:
    """A checkpoint's JSON file as a dict; FileNotFoundError (with ``missing`` as the hint) or ValueError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {missing}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); re-download the checkpoint.") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}; re-download the checkpoint.")
    return raw


def _index_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors.index.json"))


def _check_safetensors_header(path: Path) -> None:
    """Read the header and check the file holds every byte it declares (catches truncation/corruption)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n <= 0 or 8 + n > size:
                raise ValueError(f"header length {n} does not fit in a {size}-byte file")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"tensor data ends at byte {8 + n + end} but the file has {size} bytes")
    except (ValueError, KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{path} is not a valid safetensors file ({exc}); it is truncated or corrupt. "
            "Delete it and download the checkpoint again."
        ) from None


def weight_files(folder: str | Path, *, allow_pickle: bool = False) -> list[Path]:
    """The safetensors files holding a component's weights (validated), in a deterministic order.

    Accepts one ``*.safetensors`` file, or shards listed by a ``*.safetensors.index.json`` whose
    ``weight_map`` names files inside ``folder``. Pickle checkpoints are refused unless ``allow_pickle``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist or is not a folder.")
    indexes = _index_files(folder)
    if indexes:
        index = indexes[0]
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a valid shard index ({exc}); re-download the checkpoint.") from None
        root = folder.resolve()
        files = []
        for name in sorted(set(weight_map.values())):
            target = (folder / name).resolve()
            if Path(name).is_absolute() or target.parent != root:
                raise ValueError(
                    f"{index} names shard {name!r}, which is outside {folder}; shard indexes may only name "
                    "files in their own folder. The index is corrupt or malicious: re-download it."
                )
            if not target.is_file():
                raise FileNotFoundError(f"{index} names shard {name!r}, which is missing from {folder}.")
            files.append(target)
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles and allow_pickle:
            return sorted(folder / p for p in pickles)
        if pickles:
            raise ValueError(
                f"{folder} holds only pickle weights ({', '.join(sorted(pickles))}); fastwan loads safetensors only, "
                "because unpickling can run arbitrary code. Convert them to safetensors, or pass "
                "allow_pickle=True if you trust the source."
            )
        raise FileNotFoundError(f"{folder} has no *.safetensors weights (nor a *.safetensors.index.json).")
    for f in files:
        if f.suffix == ".safetensors":
            _check_safetensors_header(f)
    return files


class CheckpointTensors:
    """The tensors of a component's weight files, indexed by name and read one at a time.

    Loading streams tensor by tensor (read, cast, move to the device), so host memory holds one tensor at a
    time rather than the whole checkpoint (a 14B DiT in fp32 is 57 GB).
    """

    def __init__(self, files: list[Path]):
        self.files = files
        self.where: dict[str, Path] = {}
        self._pickled: dict[str, torch.Tensor] = {}
        for f in files:
            if f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt", device="cpu") as sf:
                    names = list(sf.keys())
            else:  # only reached with allow_pickle=True
                loaded = torch.load(f, map_location="cpu", weights_only=True)
                self._pickled.update(loaded)
                names = list(loaded)
            for key in names:
                if key in self.where:
                    raise ValueError(f"tensor {key!r} appears in more than one shard ({self.where[key]}, {f}); "
                                     "the checkpoint is inconsistent: re-download it.")
                self.where[key] = f

    def keys(self) -> list[str]:
        return list(self.where)

    def items(self):
        """Yield (name, tensor on CPU), one file open at a time."""
        for f in self.files:
            if f.suffix != ".safetensors":
                yield from ((k, v) for k, v in self._pickled.items() if self.where[k] == f)
                continue
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for key in sf.keys():
                    yield key, sf.get_tensor(key)


def load_into(
    model: torch.nn.Module,
    state: CheckpointTensors,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    keep_fp32=lambda name: False,
    source: str = "checkpoint",
) -> None:
    """Assign ``state`` to a meta-device ``model`` (``assign=True``), casting to ``dtype`` (fp32 where kept).

    Names are checked against the model before any tensor is read; tensors are then streamed one by one.
    """
    expected = set(model.state_dict().keys())
    got = set(state.keys())
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        def show(xs):
            return ", ".join(xs[:8]) + (f" ... (+{len(xs) - 8})" if len(xs) > 8 else "")

        raise ValueError(
            f"{source} does not match the Wan DiT described by its config: "
            + (f"missing {len(missing)} tensors [{show(missing)}]" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected {len(unexpected)} tensors [{show(unexpected)}]" if unexpected else "")
            + ". Check that config.json and the weights belong to the same checkpoint."
        )
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    cast = {}
    for k, v in state.items():
        if v.shape != shapes[k]:
            raise ValueError(
                f"{source}: tensor {k!r} has shape {tuple(v.shape)}, the config implies {tuple(shapes[k])}."
            )
        target = torch.float32 if keep_fp32(k) else dtype
        cast[k] = v.to(device=device, dtype=target if v.is_floating_point() else v.dtype)
    model.load_state_dict(cast, strict=True, assign=True)
