"""Safetensors-only weight loading (single file or shards + index), with checks that fail early and clearly."""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import pickle
import re
import struct
from pathlib import Path, PureWindowsPath

import torch
from safetensors import safe_open

from fastwan.checkpoint.files import new_temp_file
from fastwan.errors import CheckpointError, MissingFileError
from fastwan.values import json_text, json_type

logger = logging.getLogger("fastwan")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HUB_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")  # 'owner/name' on the Hub
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # stored as they are (their scales say what they mean)
HUB_COMMIT = re.compile(r"^[0-9a-f]{40}$")  # a Hub revision as a commit hash (a cache snapshot folder's name)


def read_json(path: str | Path, *, missing: str) -> dict:
    """A checkpoint's JSON file as a dict; MissingFileError (with ``missing`` as the hint) or CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path} is missing: {missing}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); re-download the checkpoint.") from None
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"{path} must hold a JSON object, got a JSON {json_type(raw)}; re-download the checkpoint."
        )
    return raw


# the file names diffusers and transformers save weights under; a ".VARIANT" after one of them names a variant
_WEIGHT_BASES = ("diffusion_pytorch_model", "pytorch_model", "model")
_SHARD_SUFFIX = re.compile(r"-\d+-of-\d+$")
_INDEX_NAME = re.compile(r"^(?P<base>[^.]+)\.(?:safetensors|bin)\.index(?:\.(?P<tag>[^.]+))?\.json$")


def file_variant(name: str) -> str | None:
    """The diffusers/transformers ``variant`` a weight file or shard index name belongs to (None: the plain
    files). 'fp16' for 'diffusion_pytorch_model.fp16.safetensors', 'model.fp16-00001-of-00002.safetensors',
    'model.safetensors.index.fp16.json' and the pickle names 'pytorch_model.fp16.bin',
    'pytorch_model.bin.index.fp16.json'; a name not built on one of the libraries' weight names is plain."""
    index = _INDEX_NAME.match(name)
    if index:
        base, tag = index["base"], index["tag"]
    else:
        stem = name[: -len(Path(name).suffix)] if Path(name).suffix else name
        base, _, tag = _SHARD_SUFFIX.sub("", stem).rpartition(".")
    return tag if tag and base in _WEIGHT_BASES else None


def _chosen_variant(folder: Path, names: list[str]) -> str | None:
    """Rule: a folder's weights are its plain files when it has any, else the one variant it holds (diffusers
    would need ``variant=``; one set of files is unambiguous). Several variants and no plain files: an error."""
    variants = {file_variant(n) for n in names}
    if None in variants or not variants:
        return None
    if len(variants) == 1:
        return variants.pop()
    raise CheckpointError(
        f"{folder} holds its weights only as the variants {', '.join(sorted(variants))} (no plain "
        "diffusion_pytorch_model / model files), so which set to load is ambiguous. Keep one variant's files in "
        "the folder, or add the plain ones."
    )


def weight_variant(files: list[Path]) -> str | None:
    """The ``variant`` argument diffusers' / transformers' ``from_pretrained`` needs to load ``files`` (as
    :func:`weight_files` chose them)."""
    return file_variant(files[0].name) if files else None


def plain_name_problem(name: object) -> str | None:
    """Why ``name`` is not a plain file name (None when it is).

    Rule: a plain file name is a non-empty string without a path separator ('/' or '\\'), a NUL byte or a
    drive ('C:'), and is not '.' or '..'. Weight files are addressed by such a name inside their component
    folder; where the folder entry (a symlink in the Hugging Face cache) points is not judged.
    """
    if not isinstance(name, str):
        return f"it is a JSON {json_type(name)}, not a string"
    if not name:
        return "it is empty"
    if "/" in name or "\\" in name:
        return "it contains a path separator (it is a path, not a file name; it may point outside the folder)"
    if "\0" in name:
        return "it contains a NUL byte"
    if name in (".", ".."):
        return "it names a folder ('.' or '..'), not a file"
    if PureWindowsPath(name).drive:
        return "it names a drive (it may point outside the folder)"
    return None


def _component_file(folder: Path, name: str, named_by: Path | None = None) -> Path:
    """``folder / name``, checked to be a file (a symlink is followed wherever it points)."""
    path = folder / name
    if not path.is_file():
        what = "a broken link" if path.is_symlink() else ("not a file" if path.exists() else "missing")
        where = f"{named_by} names weight file {name!r}, which is {what} in {folder}"
        if named_by is None:
            where = f"{path} is {what}"
        raise MissingFileError(f"{where}; the download is incomplete: download the checkpoint again.")
    return path


_SHARD_NAME = re.compile(r"(.+)-(\d+)-of-(\d+)\.safetensors")  # a shard's name: stem, number, shard count


def _shard_names(folder: Path, index: Path, names: list[str]) -> list[str]:
    """The shards ``index`` lists, of a folder whose files are ``names``: each entry must be a plain file name
    inside ``folder`` (see :func:`plain_name_problem`), and no shard of the set may go unnamed."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except OSError as exc:
        raise MissingFileError(
            f"{index} cannot be read ({exc}); the download is incomplete: download the checkpoint again."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{index} is not a valid shard index ({type(exc).__name__}: {exc}); it needs a \"weight_map\" object "
            "of tensor name -> shard file name. Re-download the checkpoint."
        ) from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index}: \"weight_map\" is {json_text(weight_map)[:80]}, but it must be a non-empty object of "
            "tensor name -> shard file name. Re-download the checkpoint."
        )
    for key, name in weight_map.items():
        problem = plain_name_problem(name)
        if problem is None and not name.endswith(".safetensors"):
            raise CheckpointError(
                f"{index}: weight_map entry {key!r} names shard {json_text(name)}, which is not a *.safetensors "
                "file; a safetensors index may name only safetensors files (fastwan never unpickles through an "
                "index). The index is corrupt or was tampered with: download the checkpoint again."
            )
        if problem is not None:
            raise CheckpointError(
                f"{index}: weight_map entry {key!r} names shard {json_text(name)}, which is not a plain file name "
                f"({problem}); a shard index may only name files in its own folder {folder} (outside files are "
                "refused). The index is corrupt or was tampered with: download the checkpoint again."
            )
    named = sorted(set(weight_map.values()))
    sets = {m.group(1, 3) for n in named if (m := _SHARD_NAME.fullmatch(n))}  # (stem, shard count)
    unnamed = sorted(n for n in names if n.endswith(".safetensors")
                     and n not in named and (m := _SHARD_NAME.fullmatch(n)) and m.group(1, 3) in sets)
    if unnamed:  # every shard holds tensors, so an index naming none of a shard's is incomplete
        raise CheckpointError(
            f"{index} names no tensor of {', '.join(unnamed)}, a shard of the set it reads ({', '.join(named[:2])}"
            f"{', ...' if len(named) > 2 else ''}); the index is incomplete or from another download: download the "
            "checkpoint again."
        )
    return named


_PICKLE_BASES = ("diffusion_pytorch_model", "pytorch_model", "model")  # pickle weight names (with -i-of-n shards)
_SAFETENSORS_BASES = ("diffusion_pytorch_model", "model")  # what diffusers / transformers name safetensors weights


def _weight_named(names: list[str], bases: tuple[str, ...] = _SAFETENSORS_BASES) -> list[str]:
    """Of a folder's weight file ``names``, those named as diffusers / transformers save weights (``base``,
    ``base.variant``, ``base-i-of-n``, their indexes) when there are any, as those libraries read only them (a
    backup or a LoRA file beside them is not read); else all of them (a folder of other names)."""
    named = [n for n in names if n.split(".")[0].split("-")[0] in bases]
    return named or names


def _pickle_names(folder: Path, names: list[str], *, allow_pickle: bool) -> list[str]:
    """A folder's pickle weight files when ``allow_pickle`` (those named as diffusers / transformers save weights,
    ``diffusion_pytorch_model*`` / ``pytorch_model*`` / ``model*``, when it has any; else all); otherwise an error
    naming them (or no weights)."""
    pickles = _weight_named(sorted(n for n in names if Path(n).suffix in PICKLE_SUFFIXES), _PICKLE_BASES)
    if pickles and allow_pickle:
        variant = _chosen_variant(folder, pickles)
        return [name for name in pickles if file_variant(name) == variant]
    if pickles:
        raise CheckpointError(
            f"{folder} holds only pickle weights ({', '.join(pickles)}); fastwan loads safetensors only, "
            "because unpickling can run arbitrary code. Convert them to safetensors, or pass "
            "allow_pickle=True (CLI --allow-pickle) if you trust the source."
        )
    raise MissingFileError(
        f"{folder} has no *.safetensors weights (nor a *.safetensors.index.json); download the checkpoint again."
    )


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
        if not isinstance(header, dict):
            raise ValueError(f"the header is a JSON {json_type(header)}, not an object")
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"tensor data ends at byte {8 + n + end} but the file has {size} bytes")
    except (ValueError, KeyError, TypeError, IndexError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{path} is not a valid safetensors file ({exc}); it is truncated or corrupt. "
            "Delete it and download the checkpoint again."
        ) from None


def _select(folder: Path, names: list[str], allow_pickle: bool, single_first: bool) -> tuple[list[str], str | None]:
    """(the weight file names read from a folder holding the files ``names``, the shard index naming them or
    None); see :func:`weight_files`."""
    indexes = _weight_named(sorted(n for n in names if fnmatch.fnmatchcase(n, "*.safetensors.index*.json")))
    singles = _weight_named(sorted(n for n in names if n.endswith(".safetensors")))
    variant = _chosen_variant(folder, indexes + singles)
    indexes = [n for n in indexes if file_variant(n) == variant]
    if single_first and any(file_variant(n) == variant for n in singles):
        indexes = []
    if indexes:  # the first index by name is the one read
        return _shard_names(folder, folder / indexes[0], names), indexes[0]
    return ([n for n in singles if file_variant(n) == variant]
            or _pickle_names(folder, names, allow_pickle=allow_pickle)), None


def weight_names(folder: str | Path, names: list[str], *, allow_pickle: bool = False,
                 single_first: bool = False) -> list[str]:
    """The names of the files :func:`weight_files` reads from ``folder`` when it holds the files ``names`` (a Hub
    repository's listing, before the weights are fetched); a shard index among them is read from ``folder``."""
    return _select(Path(folder), names, allow_pickle, single_first)[0]


def weight_files(folder: str | Path, *, allow_pickle: bool = False, single_first: bool = False) -> list[Path]:
    """The safetensors files holding a component's weights (validated), in a deterministic order.

    Accepts one or more ``*.safetensors`` files, or the shards listed by a ``*.safetensors.index.json``; of a
    diffusers ``variant`` (``*.fp16.safetensors``) only when the folder has no plain files (:func:`file_variant`).
    Files are addressed by their name inside ``folder`` (index entries must be plain file names) and the
    returned paths keep that name; a folder entry that is a symlink is followed wherever it points, as in
    the Hugging Face cache, whose snapshot files link into ``../../blobs/``. Pickle checkpoints are refused
    unless ``allow_pickle``. A folder holding both a shard index and single files gives the index's shards, or with
    ``single_first`` the single files (what transformers' ``from_pretrained`` reads; diffusers reads the index).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise MissingFileError(f"{folder} does not exist or is not a folder; download the checkpoint again.")
    chosen, index = _select(folder, sorted(p.name for p in folder.iterdir()), allow_pickle, single_first)
    files = [_component_file(folder, n, None if index is None else folder / index) for n in chosen]
    for f in files:
        if f.suffix == ".safetensors":
            _check_safetensors_header(f)
    return files


def _twice(key: str, first: Path, second: Path) -> CheckpointError:
    return CheckpointError(f"tensor {key!r} appears in more than one shard ({first}, {second}); the checkpoint is "
                           "inconsistent: re-download it.")


# safetensors dtype tags of floating-point tensors (what a float parameter may be loaded from)
FLOAT_TAGS = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def header_tensors(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype tag such as 'BF16'), read from the headers of the safetensors ``files``
    (no tensor data is read); a name in two files is an error."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                if key in where:
                    raise _twice(key, where[key], f)
                piece = sf.get_slice(key)
                out[key], where[key] = (tuple(piece.get_shape()), piece.get_dtype()), f
    return out


def check_names(expected, got, source: str) -> None:
    """``got``'s tensor names are exactly ``expected``'s (both name -> anything), else a CheckpointError listing
    what is missing and what is unexpected."""
    missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if not (missing or unexpected):
        return

    def show(xs):
        return ", ".join(xs[:8]) + (f" ... (+{len(xs) - 8})" if len(xs) > 8 else "")

    raise CheckpointError(
        f"{source} does not match the Wan DiT described by its config: "
        + (f"missing {len(missing)} tensors [{show(missing)}]" if missing else "")
        + ("; " if missing and unexpected else "")
        + (f"unexpected {len(unexpected)} tensors [{show(unexpected)}]" if unexpected else "")
        + ". Check that config.json and the weights belong to the same checkpoint."
    )


def shape_error(source: str, key: str, got, want) -> CheckpointError:
    return CheckpointError(f"{source}: tensor {key!r} has shape {tuple(got)}, the config implies {tuple(want)}.")


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """A pickle weight file's state dict (tensors only, ``weights_only``); a CheckpointError naming the file when it
    is not one (corrupt, or another pickle such as training_args.bin)."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:  # what torch raises for a bad file
        raise CheckpointError(f"{path} cannot be read as a weights-only state dict ({type(exc).__name__}); it is "
                              "corrupt or not a weight file (move files such as training_args.bin out of the "
                              "folder), or convert the weights to safetensors.") from None
    if not (isinstance(loaded, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                             for k, v in loaded.items())):
        raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not a state dict of tensor name -> tensor; "
                              "move it out of the folder or convert the weights to safetensors.")
    return loaded


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
                loaded = _load_pickle(f)
                self._pickled.update(loaded)
                names = list(loaded)
            for key in names:
                if key in self.where:
                    raise _twice(key, self.where[key], f)
                self.where[key] = f

    def keys(self) -> list[str]:
        return list(self.where)

    def items(self):
        """Yield (name, tensor on CPU), one file open at a time, each checked to hold finite values."""
        for f in self.files:
            if f.suffix != ".safetensors":
                yield from ((k, check_finite(k, v, f)) for k, v in self._pickled.items() if self.where[k] == f)
                continue
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for key in sf.keys():
                    yield key, check_finite(key, sf.get_tensor(key), f)


def check_finite(key: str, tensor: torch.Tensor, path: Path) -> torch.Tensor:
    """``tensor`` (``key`` of the file ``path``) when it holds no NaN or infinity, else a CheckpointError naming both:
    a non-finite weight makes every later activation NaN (an all-black video). One pass over the tensor (its
    minimum and maximum, which NaN and infinities reach: several times faster than ``isfinite`` on the CPU)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return tensor
    lo, hi = torch.aminmax(tensor.to(torch.bfloat16) if tensor.dtype in FP8 else tensor)  # exact for FP8
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return tensor
    flat = tensor.reshape(-1).to(torch.bfloat16 if tensor.dtype in FP8 else tensor.dtype)
    nan, inf = int(flat.isnan().sum()), int(flat.isinf().sum())
    what = " and ".join(s for s in (f"{nan} NaN" if nan else "", f"{inf} infinite" if inf else "") if s)
    raise CheckpointError(
        f"{path}: tensor {key!r} holds {what} value(s) of {tensor.numel()}; a model with non-finite weights makes "
        "NaN activations (a black video). The file is corrupt, or was saved from a diverged training run: download "
        "or export the checkpoint again.")


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
    Rule for FP8 storage: an FP8 slot of the model (a layer saved with its scales) takes the FP8 tensor as it is;
    an FP8 tensor for any other slot is a plain value stored in 8 bits (no scale) and is cast like any float, as
    diffusers' ``from_pretrained`` does.

    Names are checked against the model before any tensor is read; tensors are then streamed one by one.
    """
    check_names(model.state_dict(), state.keys(), source)
    slots = model.state_dict()
    cast = {}
    upcast = []
    for k, v in state.items():
        if v.shape != slots[k].shape:
            raise shape_error(source, k, v.shape, slots[k].shape)
        if slots[k].is_floating_point() and not v.is_floating_point():
            raise CheckpointError(f"{source}: tensor {k!r} is {str(v.dtype).replace('torch.', '')}, but the model "
                                  "holds a floating-point weight there; the checkpoint is corrupt: re-download it.")
        if v.dtype in FP8 and slots[k].dtype not in FP8:
            upcast.append(k)
            v = v.float()  # exact: every FP8 value is a bf16 / fp16 / fp32 value
        if (slots[k].dtype in FP8) != (v.dtype in FP8):
            raise CheckpointError(f"{source}: tensor {k!r} is {str(v.dtype).replace('torch.', '')}, but the model "
                                  f"holds it as {str(slots[k].dtype).replace('torch.', '')} (FP8 weights come only "
                                  "with their scales); the checkpoint is inconsistent: re-download or re-quantize it.")
        target = v.dtype if v.dtype in FP8 else torch.float32 if keep_fp32(k) else dtype
        cast[k] = v.to(device=device, dtype=target if v.is_floating_point() else v.dtype)
    if upcast:
        logger.info("%s: %d tensors stored in FP8 without scales (e.g. %s) were cast to %s", source, len(upcast),
                    upcast[0], str(dtype).replace("torch.", ""))
    model.load_state_dict(cast, strict=True, assign=True)


def write_atomically(path: Path, write) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, then move it onto ``path``: the file is replaced whole
    or not at all (the temporary file is removed when writing fails), with a new file's mode (0o666 less the
    umask, :mod:`fastwan.checkpoint.files`)."""
    tmp = str(new_temp_file(path.parent, f".{path.name}.", ".tmp"))
    mode = os.stat(tmp).st_mode & 0o7777  # a new file's: 0o666 less the umask
    try:
        write(tmp)
        os.chmod(tmp, mode)  # back to a new file's, should write() have made the file owner-only
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
