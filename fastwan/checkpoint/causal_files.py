"""Self-Forcing's and CausVid's released generator files, loaded over a base Wan2.1 text-to-video checkpoint.

The published files are torch pickles of their training wrappers' state dicts: Self-Forcing's
``self_forcing_dmd.pt`` is ``{"generator": ..., "critic": ..., "generator_ema": ...}`` (its README runs inference
with ``--use_ema``: ``generator_ema``), CausVid's ``model.pt`` ``{"generator": ...}``; each generator is a
``WanDiffusionWrapper`` whose DiT sits at ``model.``, under the original Wan names
(``model.blocks.0.self_attn.q.weight``). A causal DiT has exactly the plain Wan2.1 DiT's parameters, so the base
checkpoint gives the config, text encoder and VAE and the file's tensors replace its DiT's.

Read (:func:`read_generator_file`): a ``.safetensors`` file always; a pickle (``.pt``, ``.pth``, ``.bin``, ``.ckpt``,
``.pkl``) only when the caller allows pickle, and then weights-only (tensors and plain containers). Nested
dictionaries read as dotted names; the DiT's entry is ``generator_ema`` when present, else ``generator`` (a flat
file: all of it); a ``model.`` prefix on every name is the wrapper's and is dropped; each name then maps through
:data:`fastwan.models.wan.names.ORIGINAL_NAMES`. Checked from the names, shapes and dtypes before any tensor is
read: names that are no original Wan name (the diffusers spelling said so), tensors the base DiT lacks or the file
lacks, shapes unlike the base DiT's, non-float tensors. The sampling rule is the family's (:data:`FAMILY_RECIPES`):
the files do not say which training made them.
"""
from __future__ import annotations

import dataclasses
import pickle
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open

from fastwan.checkpoint.causal import CausalRecipe
from fastwan.checkpoint.causal_layouts import FAMILY_RECIPES, causal_preset
from fastwan.checkpoint.safetensors import FLOAT_TAGS, PICKLE_SUFFIXES, check_finite
from fastwan.errors import CheckpointError, InvalidArgument, InvalidArgumentType, MissingFileError
from fastwan.models.wan.config import WanConfig
from fastwan.models.wan.names import dit_name
from fastwan.models.wan.transformer import WanTransformer
from fastwan.options import DiTOptions

ENTRIES = ("generator_ema", "generator")  # the generator's entry in a training checkpoint, preferred first
WRAPPER_PREFIX = "model."  # the DiT inside Self-Forcing's / CausVid's WanDiffusionWrapper
BASE_PIPELINE = "WanPipeline"  # the base checkpoint's pipeline class: Wan2.1 text-to-video
_FLOAT_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                 torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _show(names, n: int = 6) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f" ... (+{len(names) - n})" if len(names) > n else "")


def check_generator_path(path, allow_pickle: bool, name: str = "causal_weights") -> Path:
    """``path`` as a Path when it names an existing generator file fastwan may read: ``.safetensors`` always, a
    pickle (:data:`~fastwan.checkpoint.safetensors.PICKLE_SUFFIXES`) only with ``allow_pickle``."""
    if not isinstance(path, (str, Path)) or not str(path).strip():
        raise InvalidArgumentType(f"{name}={path!r} must be the path of a generator file (e.g. "
                                  "'self_forcing_dmd.pt').")
    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    if suffix != ".safetensors" and suffix not in PICKLE_SUFFIXES:
        raise InvalidArgument(f"{name}={str(path)!r}: a generator file is .safetensors or a torch pickle "
                              f"({', '.join(PICKLE_SUFFIXES)}), not {suffix or 'a file without a suffix'}.")
    if not path.is_file():
        raise MissingFileError(f"{name}={str(path)!r} is not a file; pass the Self-Forcing / CausVid generator file "
                               "(e.g. checkpoints/self_forcing_dmd.pt).")
    if suffix in PICKLE_SUFFIXES and not allow_pickle:
        raise InvalidArgument(f"{name}={str(path)!r} is a torch pickle; unpickling can run code, so fastwan reads it "
                              "only when you allow it: pass allow_pickle=True (CLI --allow-pickle) if you trust "
                              "the file (it is then read weights-only), or convert it to safetensors.")
    return path


def _flatten(tree, prefix: str, out: dict) -> None:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, dict):
            _flatten(value, f"{name}.", out)


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a pickled training checkpoint, nested dictionaries as dotted names, read weights-only (mapped
    from the file when torch saved it as a zip archive: only the tensors used are read)."""
    try:
        tree = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        raise CheckpointError(f"{path} cannot be read as a weights-only torch checkpoint ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); it is corrupt, holds more than "
                              "tensors and plain containers, or is not a torch file.") from None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path} holds a {type(tree).__name__}, not a dictionary of tensors; a Self-Forcing / "
                              "CausVid generator file is a dict such as {'generator': ..., 'generator_ema': ...}.")
    out: dict[str, torch.Tensor] = {}
    _flatten(tree, "", out)
    return out


def _file_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype tag or the torch dtype's name) of every tensor of the file."""
    if path.suffix.lower() == ".safetensors":
        try:
            with safe_open(str(path), framework="pt", device="cpu") as sf:
                return {k: (tuple(sf.get_slice(k).get_shape()), sf.get_slice(k).get_dtype()) for k in sf.keys()}
        except Exception as exc:  # safetensors raises its own error types for a bad header
            raise CheckpointError(f"{path} is not a valid safetensors file ({type(exc).__name__}: {exc}); it is "
                                  "truncated or corrupt.") from None
    return {k: (tuple(v.shape), _FLOAT_DTYPES.get(v.dtype, str(v.dtype))) for k, v in _load_pickle(path).items()}


def _entry(names: list[str]) -> str:
    """The prefix of the generator's tensors: ``generator_ema.`` or ``generator.`` when the file nests them so (the
    EMA weights first, as Self-Forcing's README runs them), else '' (a flat state dict)."""
    return next((f"{e}." for e in ENTRIES if any(n.startswith(f"{e}.") for n in names)), "")


@dataclasses.dataclass(frozen=True)
class GeneratorWeights:
    """A generator file's DiT tensors, checked, by the DiT's names: ``keys()`` and ``items()`` as the DiT's loader
    reads a checkpoint (each tensor checked finite when read). ``entry``: the nesting read ('generator_ema.',
    'generator.' or ''); ``names``: (DiT name, the file's name) pairs."""

    path: Path
    entry: str
    names: tuple[tuple[str, str], ...] = dataclasses.field(repr=False)

    def keys(self) -> list[str]:
        return [dit for dit, _ in self.names]

    def items(self):
        if self.path.suffix.lower() == ".safetensors":
            with safe_open(str(self.path), framework="pt", device="cpu") as sf:
                for dit, key in self.names:
                    yield dit, check_finite(key, sf.get_tensor(key), self.path)
            return
        tensors = _load_pickle(self.path)
        for dit, key in self.names:
            yield dit, check_finite(key, tensors[key], self.path)


def read_generator_file(path, cfg: WanConfig, allow_pickle: bool, base: str = "the base checkpoint"
                        ) -> GeneratorWeights:
    """The DiT tensors of the Self-Forcing / CausVid generator file ``path``, checked against the DiT ``cfg``
    describes (the base checkpoint's, named ``base`` in errors) before any tensor is read."""
    path = check_generator_path(path, allow_pickle)
    found = _file_tensors(path)
    entry = _entry(list(found))
    names = [n for n in found if n.startswith(entry)]
    short = [n[len(entry):] for n in names]
    prefix = WRAPPER_PREFIX if short and all(n.startswith(WRAPPER_PREFIX) for n in short) else ""
    where = f"{path} ({entry[:-1]!r})" if entry else str(path)
    if not names:
        raise CheckpointError(f"{path} holds no tensors; a generator file holds a Wan DiT's state dict.")
    with torch.device("meta"):
        slots = WanTransformer(cfg, None, DiTOptions(block="reference")).state_dict()
    mapped: dict[str, str] = {}
    unknown = []
    for key, name in zip(names, short):
        dit = dit_name(name[len(prefix):])
        if dit is None:
            unknown.append(key)
        elif dit in mapped:
            raise CheckpointError(f"{where}: tensors {mapped[dit]!r} and {key!r} both name the DiT's {dit!r}; the "
                                  "file is inconsistent.")
        else:
            mapped[dit] = key
    if unknown:
        diffusers = [k for k in unknown if k[len(entry):].removeprefix(prefix) in slots]
        if diffusers:
            raise CheckpointError(
                f"{where} names its tensors as diffusers does ({_show(diffusers)}), not as the original Wan release "
                "does (a Self-Forcing / CausVid generator: 'model.blocks.0.self_attn.q.weight'). A DiT saved under "
                "diffusers' names is a Diffusers-layout checkpoint: pass its pipeline folder (with the DiT in "
                "transformer/) as the model instead.")
        raise CheckpointError(
            f"{where}: {len(unknown)} tensors are no original Wan DiT names ({_show(unknown)}); the file is not a "
            "Wan generator (Self-Forcing's self_forcing_dmd.pt or CausVid's model.pt hold "
            "'model.blocks.0.self_attn.q.weight' and the like).")
    missing, extra = [k for k in slots if k not in mapped], [mapped[k] for k in mapped if k not in slots]
    if missing or extra:
        raise CheckpointError(
            f"{where} does not hold the DiT of {base}: "
            + (f"missing {len(missing)} tensors [{_show(missing)}] (the DiT's names)" if missing else "")
            + ("; " if missing and extra else "")
            + (f"{len(extra)} tensors the DiT has no place for [{_show(extra)}]" if extra else "")
            + ". The file must hold a whole Wan2.1 text-to-video DiT of the base checkpoint's architecture.")
    for dit, key in mapped.items():
        shape, tag = found[key]
        if shape != tuple(slots[dit].shape):
            raise CheckpointError(
                f"{where}: tensor {key!r} has shape {shape}, but {base}'s DiT holds {tuple(slots[dit].shape)} at "
                f"{dit!r}; the base checkpoint must be the Wan2.1 text-to-video model the generator was trained from "
                "(Self-Forcing and CausVid: Wan-AI/Wan2.1-T2V-1.3B-Diffusers).")
        if tag not in FLOAT_TAGS:
            raise CheckpointError(f"{where}: tensor {key!r} is stored as {tag}, but the DiT holds a floating-point "
                                  "weight there; the file is corrupt.")
    return GeneratorWeights(path, entry, tuple(mapped.items()))


def family_recipe(family) -> CausalRecipe:
    """The sampling rule of ``family`` (a key of :data:`FAMILY_RECIPES`, None for Self-Forcing, or a
    :class:`CausalRecipe` of one's own)."""
    if isinstance(family, CausalRecipe):
        return family
    if family is None:
        return FAMILY_RECIPES["self-forcing"]
    if family not in FAMILY_RECIPES:
        raise (InvalidArgument if isinstance(family, str) else InvalidArgumentType)(
            f"causal_recipe={family!r} must be one of {', '.join(map(repr, FAMILY_RECIPES))} (the family whose "
            "inference config the generator file was trained for), a fastwan CausalRecipe, or None "
            "('self-forcing').")
    return FAMILY_RECIPES[family]


def with_causal_weights(ckpt, path, family, allow_pickle: bool):
    """``ckpt`` (a resolved :class:`~fastwan.checkpoint.resolver.Checkpoint`) with its DiT's tensors taken from
    the generator file ``path`` and sampling causally with ``family``'s rule (:func:`family_recipe`). Rule: the base
    is a one-DiT Wan2.1 text-to-video checkpoint (``WanPipeline``: plain DiT, no VSA gates), not causal already."""
    recipe = family_recipe(family)
    cls = ckpt.index.get("_class_name")
    if cls != BASE_PIPELINE or ckpt.variant != "wan2.1" or ckpt.causal is not None or ckpt.vsa_gates:
        what = "already causal (it carries its own DiT and rule)" if ckpt.causal is not None else (
            f"a {cls} checkpoint of kind {ckpt.variant}" + (" with VSA gates" if ckpt.vsa_gates else ""))
        raise InvalidArgument(
            f"causal_weights={str(path)!r} replaces the DiT of a Wan2.1 text-to-video checkpoint "
            f"(\"_class_name\": \"{BASE_PIPELINE}\"), but {ckpt.root} is {what}. Pass the base model the generator "
            "was trained from (Self-Forcing and CausVid: Wan-AI/Wan2.1-T2V-1.3B-Diffusers).")
    weights = read_generator_file(path, ckpt.transformer_config, allow_pickle, f"the base checkpoint {ckpt.root}")
    preset = causal_preset(ckpt.preset, recipe, ckpt.transformer_config.inner_dim)
    return dataclasses.replace(ckpt, causal=recipe, dit_weights=weights, preset=preset)


def causal_checkpoint(ckpt, options):
    """``ckpt`` as ``options`` (a :class:`~fastwan.pipelines.load_options.LoadOptions`) load it: with the DiT of
    their ``causal_weights`` file and its ``causal_recipe`` (:func:`with_causal_weights`) when given, else as it is."""
    if options.causal_weights is None:
        return ckpt
    return with_causal_weights(ckpt, options.causal_weights, options.causal_recipe, options.allow_pickle)
