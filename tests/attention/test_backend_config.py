"""Backend settings: which config keys a backend takes, configs that cannot apply, and settings errors that
automatic selection must not swallow. GPUs are faked (see conftest); no kernel runs."""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from fastwan.attention import BACKENDS, attention, attention_backend, create_backend, resolve_backend
from fastwan.attention.backends.flash import FlashAttnBackend
from fastwan.attention.backends.sdpa import TorchSDPABackend
from fastwan.errors import InvalidArgument, InvalidArgumentType, UserError

BF16 = torch.bfloat16
SETTINGS_ENV = ("FASTWAN_SDPA_KERNEL", "FASTWAN_FLASH_ATTN_VERSION", "FASTVIDEO_NVFP4_FA4")


@pytest.fixture(autouse=True)
def clean_settings_env(monkeypatch):
    for var in SETTINGS_ENV:
        monkeypatch.delenv(var, raising=False)


def backend_class(name):
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


# ---- config keys a backend takes ----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(BACKENDS))
def test_declared_keys_are_exactly_the_constructor_keywords(name):
    klass = backend_class(name)
    params = inspect.signature(klass.__init__).parameters.values()
    variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)  # object.__init__: *args, **kw
    named = {p.name for p in params if p.name != "self" and p.kind not in variadic}
    assert set(klass.KEYS) == named


@pytest.mark.parametrize(
    "name,config,accepted",
    [
        ("TORCH_SDPA", {"window": 3}, "valid keys are kernel"),
        ("FLASH_ATTN", {"window": [3, 3, 3], "sparsity": 0.5}, "valid keys are version, nvfp4, fa4_tile_m, fa4_split"),
        ("SAGE_ATTN", {"sparsity": 0.5}, "takes no settings"),
    ],
)
def test_dense_backend_rejects_keys_it_does_not_take(name, config, accepted):
    with pytest.raises(InvalidArgument) as e:
        create_backend(name, config)
    msg = str(e.value)
    assert isinstance(e.value, UserError) and not isinstance(e.value, TypeError)
    assert msg.startswith(f"{name}: unknown config key(s)") and accepted in msg
    for key in config:
        assert repr(key) in msg
    if "window" in config:
        assert "'window' is a setting of SLIDING_TILE_ATTN" in msg
    if "sparsity" in config:
        assert "'sparsity' is a setting of VIDEO_SPARSE_ATTN" in msg


def test_unknown_key_is_rejected_before_the_backend_is_built(monkeypatch):
    built = []
    monkeypatch.setattr(TorchSDPABackend, "__init__", lambda self, kernel=None: built.append(kernel))
    with pytest.raises(InvalidArgument, match="'window'"):
        resolve_backend("TORCH_SDPA", device="cpu", dtype=BF16, head_dim=64, config={"window": 3}, env={})
    assert built == []


def test_dense_backend_accepts_its_own_keys():
    assert create_backend("TORCH_SDPA", {"kernel": "MATH"}).kernel == "math"
    b = create_backend("FLASH_ATTN", {"version": "3", "nvfp4": False, "fa4_tile_m": "auto", "fa4_split": False})
    assert (b.version, b.nvfp4, b.fa4_split) == (3, False, False)
    assert create_backend("SAGE_ATTN", {}).name == "SAGE_ATTN"


def test_config_must_be_a_mapping():
    with pytest.raises(InvalidArgumentType, match=r"must be a dict of SLIDING_TILE_ATTN's settings"):
        create_backend("SLIDING_TILE_ATTN", [("window", 3)])


@pytest.mark.parametrize("make", [lambda: TorchSDPABackend(kernel=5), lambda: FlashAttnBackend(version=[2]),
                                  lambda: FlashAttnBackend(version="x")])
def test_badly_typed_dense_settings_are_invalid_arguments(make):
    with pytest.raises(InvalidArgument):
        make()


# ---- a config with an already-built backend ---------------------------------------------------------------

def test_config_with_a_backend_instance_is_an_error():
    sta = create_backend("SLIDING_TILE_ATTN")
    with pytest.raises(InvalidArgument) as e:
        resolve_backend(sta, device="cpu", dtype=torch.float32, head_dim=64, config={"window": [5, 5, 5]}, env={})
    msg = str(e.value)
    assert "['window']" in msg and "SLIDING_TILE_ATTN" in msg
    assert "constructor" in msg and "by name" in msg
    assert sta.window == (3, 3, 3)


def test_config_with_a_scoped_instance_or_standalone_call_is_an_error():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(InvalidArgument, match="already-built TORCH_SDPA"):
        attention(q, q, q, backend=TorchSDPABackend(), config={"kernel": "math"})
    with attention_backend(TorchSDPABackend()), pytest.raises(InvalidArgument, match="attention_backend\\(\\) context"):
        resolve_backend(None, device="cpu", dtype=torch.float32, head_dim=8, config={"kernel": "math"}, env={})


def test_instance_without_config_is_used_as_is():
    sdpa = TorchSDPABackend("math")
    assert resolve_backend(sdpa, device="cpu", dtype=torch.float32, head_dim=8, config={}, env={}) is sdpa
    assert resolve_backend(sdpa, device="cpu", dtype=torch.float32, head_dim=8, config=None, env={}) is sdpa


# ---- automatic selection and settings errors ----------------------------------------------------------------

def test_auto_raises_on_a_bad_sdpa_kernel_env(monkeypatch, no_packages):
    monkeypatch.setenv("FASTWAN_SDPA_KERNEL", "garbage")
    with pytest.raises(InvalidArgument, match="FASTWAN_SDPA_KERNEL='garbage'"):
        resolve_backend(None, device="cpu", dtype=torch.float32, head_dim=64, env={})


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_raises_on_a_bad_flash_version_env(monkeypatch, fake_gpu, device):
    fake_gpu(cc=(9, 0), fa={4})
    monkeypatch.setenv("FASTWAN_FLASH_ATTN_VERSION", "7")
    with pytest.raises(InvalidArgument, match="FASTWAN_FLASH_ATTN_VERSION='7'"):
        resolve_backend(None, device=device, dtype=BF16, head_dim=128, env={})


def test_auto_still_skips_a_backend_that_cannot_run(no_packages):
    assert resolve_backend(None, device="cpu", dtype=torch.float32, head_dim=64, env={}).name == "TORCH_SDPA"


def test_auto_does_not_hide_a_failing_constructor(monkeypatch, fake_gpu):
    def broken(self, *args, **kwargs):
        raise RuntimeError("constructor bug")

    monkeypatch.setattr(FlashAttnBackend, "__init__", broken)
    with pytest.raises(RuntimeError, match="constructor bug"):
        resolve_backend(None, device="cuda", dtype=BF16, head_dim=128, env={})
