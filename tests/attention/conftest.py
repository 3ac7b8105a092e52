"""Fake machines for the attention tests: GPUs and installed packages are faked by monkeypatching torch.cuda and
the package probes, so what is tested is the capability -> reason logic, never a kernel."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastwan.attention import base
from fastwan.attention.backends import packages


@pytest.fixture
def no_packages(monkeypatch):
    """Nothing external installed, whatever this machine has."""
    monkeypatch.setattr(packages, "flash_installed", lambda version: False)
    monkeypatch.setattr(packages, "sage_major", lambda: None)
    real = base.package_available
    monkeypatch.setattr(base, "package_available", lambda n: False if n in ("sageattention", "triton") else real(n))


@pytest.fixture
def fake_gpu(monkeypatch):
    """A pretend CUDA device; returns a setter for (compute capability, installed FA versions, sage major)."""
    state = {"cc": (9, 0), "fa": {4}, "sage": None}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["cc"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(packages, "flash_installed", lambda v: v in state["fa"])
    monkeypatch.setattr(packages, "flash_import_error", lambda v: None)
    monkeypatch.setattr(packages, "sage_import_error", lambda: None)
    monkeypatch.setattr(packages, "sage_major", lambda: state["sage"])
    monkeypatch.setattr(packages, "sage_package_version", lambda: {1: "1.0.6", 2: "2.2.0"}.get(state["sage"]))
    real = base.package_available
    monkeypatch.setattr(
        base, "package_available",
        lambda n: (state["sage"] is not None) if n in ("sageattention", "triton") else real(n),
    )

    def set_(cc=None, fa=None, sage="keep"):
        if cc is not None:
            state["cc"] = cc
        if fa is not None:
            state["fa"] = set(fa)
        if sage != "keep":
            state["sage"] = sage

    return set_
