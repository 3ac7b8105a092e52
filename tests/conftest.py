import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from fastwan.checkpoint.tiny import write_tiny_checkpoint

# Rule: the suite is hermetic. Its home, caches and Hugging Face folder lie in one temporary folder, and the
# caller's variables that change what fastwan, FastVideo or the Hub libraries do are cleared.
HERMETIC_FOLDERS = {"HOME": "home", "XDG_CACHE_HOME": "xdg-cache", "XDG_CONFIG_HOME": "xdg-config",
                    "XDG_DATA_HOME": "xdg-data", "FASTWAN_CACHE": "fastwan-cache", "HF_HOME": "hf"}
CLEARED_PREFIXES = ("FASTWAN_", "FASTVIDEO_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DIFFUSERS_")
SAVED_ENV = pytest.StashKey[tuple[dict, Path]]()


def pytest_configure(config):
    """Set the hermetic environment before any test module is imported (huggingface_hub reads its folders from
    the environment when it is imported)."""
    saved = dict(os.environ)
    root = Path(tempfile.mkdtemp(prefix="fastwan-tests-"))
    for name in [k for k in os.environ if k.startswith(CLEARED_PREFIXES)]:
        del os.environ[name]
    for name, folder in HERMETIC_FOLDERS.items():
        (root / folder).mkdir()
        os.environ[name] = str(root / folder)
    config.stash[SAVED_ENV] = saved, root


def pytest_unconfigure(config):
    saved, root = config.stash[SAVED_ENV]
    os.environ.clear()
    os.environ.update(saved)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory):
    """Tiny random Diffusers-layout checkpoints of the three variants (written once per test session)."""
    root = tmp_path_factory.mktemp("tiny")
    return {v: write_tiny_checkpoint(root / v, v, seed=i) for i, v in
            enumerate(("wan2.1", "wan2.2-a14b", "wan2.2-ti2v"))}


@pytest.fixture(scope="module")
def gen(tiny_ckpts):
    """A tiny Wan2.1 generator on the CPU in fp32, one per test module."""
    from fastwan import VideoGenerator

    return VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32)


@pytest.fixture
def forbid_compute(monkeypatch):
    """A function that makes any later text-encoder or denoiser call of a generator fail the test: what is
    checked must be checked before work starts."""
    def forbid(g):
        def boom(*a, **k):
            raise AssertionError("compute started before the checks finished")
        monkeypatch.setattr(g, "_denoise", boom)
        monkeypatch.setattr(g.text_encoder, "forward", boom)
        return g
    return forbid


@pytest.fixture
def no_compute(gen, forbid_compute):
    """``gen`` with compute forbidden (see ``forbid_compute``)."""
    return forbid_compute(gen)


@pytest.fixture
def no_profiling(monkeypatch):
    """Any planning or timing by the profiler CLI fails the test: what is checked must be checked before work."""
    from fastwan.profiler import cli

    def boom(*a, **k):
        raise AssertionError("profiling started before the arguments were checked")
    monkeypatch.setattr(cli, "plan", boom)
    monkeypatch.setattr(cli, "run", boom)
