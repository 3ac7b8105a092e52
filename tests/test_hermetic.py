"""The suite is hermetic: whatever the caller's environment, tests see a home, caches and a Hugging Face folder of
their own (inside one temporary folder) and none of the caller's fastwan / FastVideo / Hugging Face variables, so
no test depends on them and none writes into the user's own caches (tests/conftest.py sets this up)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fastwan import envs
from fastwan.checkpoint.tiny import tiny_cache_dir

PREFIXES = ("FASTWAN_", "FASTVIDEO_", "HF_", "HUGGINGFACE_")


def _inside_temp(path: str | Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())


def test_home_and_caches_are_temporary():
    for name in ("HOME", "XDG_CACHE_HOME", "FASTWAN_CACHE", "HF_HOME"):
        assert _inside_temp(os.environ[name]), name
    assert _inside_temp(Path("~").expanduser())
    assert _inside_temp(envs.cache_dir()) and _inside_temp(tiny_cache_dir())


def test_callers_variables_are_cleared():
    own = {"FASTWAN_CACHE", "HF_HOME"}  # the suite's own temporary folders
    assert sorted(k for k in os.environ if k.startswith(PREFIXES) and k not in own) == []


def test_hub_cache_is_temporary():
    from huggingface_hub import constants

    assert _inside_temp(constants.HF_HUB_CACHE) and _inside_temp(constants.HF_HOME)
