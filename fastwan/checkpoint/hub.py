"""Fetching a checkpoint from the Hugging Face Hub: only the files fastwan reads.

Rules:

- A Hub id's ``model_index.json`` is fetched alone first (the caller checks it before anything else is fetched).
- Then each component's small files (configs, shard indexes, tokenizer files); then, online, only the weight files
  :func:`fastwan.checkpoint.safetensors.weight_names` picks from the repository's listing (the plain files, or the one
  variant; safetensors before pickle; an index's own shards), as diffusers fetches one variant and no pickle
  beside safetensors. Offline, the cache holds what it holds: the same patterns as the small files' cover
  every weight file there.
- Errors name the model id and what to do (:func:`download`).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from fastwan.errors import MissingFileError
from fastwan.checkpoint.safetensors import PICKLE_SUFFIXES, weight_names

SMALL_FILES = ("*.json", "*.model", "*.txt")  # configs, shard indexes, tokenizer files
WEIGHT_FILES = ("*.safetensors",)


def download(model_id: str, patterns: list[str], revision: str | None = None) -> Path:
    """``snapshot_download`` of the files matching ``patterns`` (from the cache when offline); the snapshot
    folder. Its files may be symlinks into the cache's ``blobs/``."""
    from huggingface_hub import snapshot_download

    with _hub_errors(model_id):
        return Path(snapshot_download(model_id, revision=revision, allow_patterns=patterns))


def repo_files(model_id: str, revision: str | None) -> list[str] | None:
    """The repository's file paths at ``revision``, or None offline (``HF_HUB_OFFLINE``: no listing is asked)."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return None
    with _hub_errors(model_id):
        return list(HfApi().list_repo_files(model_id, revision=revision))


def fetch_components(model_id: str, revision: str | None, weighted: dict[str, bool], others: tuple[str, ...],
                     allow_pickle: bool) -> Path:
    """Fetch the components of a Hub checkpoint whose ``model_index.json`` is already in the cache -> the snapshot
    folder. ``weighted``: component -> whether transformers reads it (its single weight file before a shard
    index); ``others``: components without weights (tokenizer, scheduler, image processor)."""
    small = ["model_index.json"] + [f"{c}/{s}" for c in (*weighted, *others) for s in SMALL_FILES]
    root = download(model_id, small, revision)
    listing = repo_files(model_id, revision)
    if listing is None:
        suffixes = WEIGHT_FILES + (tuple(f"*{s}" for s in PICKLE_SUFFIXES) if allow_pickle else ())
        return download(model_id, small + [f"{c}/{s}" for c in weighted for s in suffixes], revision)
    weights = []
    for comp, single_first in weighted.items():
        names = [p[len(comp) + 1:] for p in listing if p.startswith(f"{comp}/") and "/" not in p[len(comp) + 1:]]
        if names and (root / comp).is_dir():  # a missing component is reported by the component checks
            weights += [f"{comp}/{n}" for n in weight_names(root / comp, names, allow_pickle=allow_pickle,
                                                            single_first=single_first)]
    return download(model_id, ["model_index.json"] + weights, revision)  # the small files are there already


@contextmanager
def _hub_errors(model_id: str):
    """huggingface_hub's missing-repository and offline errors as MissingFileErrors naming ``model_id``."""
    from huggingface_hub import errors as hf_errors

    incomplete = getattr(hf_errors, "IncompleteSnapshotError", ())  # huggingface_hub >= 2
    try:
        yield
    except (hf_errors.RepositoryNotFoundError, hf_errors.RevisionNotFoundError, hf_errors.GatedRepoError) as exc:
        raise MissingFileError(
            f"model {model_id!r} is neither a local folder nor a Hub repository you can access ({type(exc).__name__}). "
            "Pass a Diffusers-format Wan folder, a Hub id such as 'Wan-AI/Wan2.1-T2V-1.3B-Diffusers', or 'tiny'."
        ) from None
    except incomplete as exc:
        raise MissingFileError(
            f"model {model_id!r} is in the Hugging Face cache, but its snapshot misses files ({exc}). Download it "
            "again with network access (unset HF_HUB_OFFLINE), or pass a complete local folder."
        ) from None
    except hf_errors.LocalEntryNotFoundError:
        raise MissingFileError(
            f"model {model_id!r} is not a local folder and is not in the Hugging Face cache, and the Hub cannot be "
            "reached (offline or HF_HUB_OFFLINE=1). Download it first or pass a local folder."
        ) from None
