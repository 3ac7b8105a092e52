"""Backend selection and settings: which config keys a backend takes, configs that cannot apply, and settings errors
that automatic selection must not swallow; every bad request is a user error raised before work (naming the value,
the rule and the fix), never a raw exception from torch or a setting silently read as something else. GPUs are
faked (see conftest); no kernel runs but the CPU SDPA path, checked against a float64 computation."""
from __future__ import annotations

import importlib
import inspect
import json
import math
import re

import numpy as np
import pytest
import torch

from fastwan.attention import (BACKENDS, AttentionDispatch, BackendUnavailableError, attention, attention_backend,
                               auto_backend, create_backend, resolve_backend)
from fastwan.attention.backends.flash import FlashAttnBackend
from fastwan.attention.backends.sdpa import TorchSDPABackend
from fastwan.attention.registry import OTHER_NAMES
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


# ---- bad requests, each a user error before work ------------------------------------------------------------------
def reference(q, k, v, scale):
    """softmax(q k^T * scale) v in float64, [B, S, H, D] layout."""
    q, k, v = (t.double() for t in (q, k, v))
    p = (torch.einsum("bqhd,bkhd->bhqk", q, k) * scale).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def qkv(sq=5, skv=3, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, s, 2, d, generator=g) for s in (sq, skv, skv))


# ---- a CUDA index this machine lacks ----------------------------------------------------------------------------

@pytest.fixture
def one_gpu(fake_gpu, monkeypatch):
    """A machine with one (fake) GPU whose capability query fails for any other index, as torch's does."""
    def capability(device=None):
        index = torch.device(device).index if isinstance(device, (str, torch.device)) else device
        if index not in (None, 0):
            raise AssertionError("Invalid device id")  # torch.cuda.get_device_properties' own check
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    return fake_gpu


@pytest.mark.parametrize("requested", [None, "FLASH_ATTN", "SAGE_ATTN", "TORCH_SDPA"])
def test_missing_cuda_index_is_a_reason_not_an_assertion(one_gpu, requested):
    one_gpu(fa={2, 3, 4}, sage=1)
    with pytest.raises(BackendUnavailableError) as e:
        resolve_backend(requested, device="cuda:3", dtype=BF16, head_dim=128, env={})
    msg = str(e.value)
    assert "CUDA device cuda:3 cannot be used" in msg and "this machine has 1 CUDA device(s) (cuda:0 to cuda:0)" in msg
    # the device that exists still resolves
    assert resolve_backend(requested, device="cuda:0", dtype=BF16, head_dim=128, env={}).name == (
        requested or "FLASH_ATTN")


# ---- settings read as something else -------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["false", "0", 0, 1, "true"])
def test_flash_nvfp4_setting_must_be_a_bool(value):
    with pytest.raises(InvalidArgumentType, match=re.escape(f"nvfp4={value!r} must be True or False")):
        create_backend("FLASH_ATTN", {"nvfp4": value})
    assert create_backend("FLASH_ATTN", {"nvfp4": False}).nvfp4 is False
    assert create_backend("FLASH_ATTN", {"nvfp4": True}).nvfp4 is True


def test_sdpa_kernel_setting_empty_is_refused_and_spaces_are_trimmed(monkeypatch):
    monkeypatch.delenv("FASTWAN_SDPA_KERNEL", raising=False)
    with pytest.raises(InvalidArgument, match="SDPA kernel '' is unknown; use one of auto, flash"):
        create_backend("TORCH_SDPA", {"kernel": ""})
    assert create_backend("TORCH_SDPA", {"kernel": " Math "}).kernel == "math"  # as FASTWAN_SDPA_KERNEL is read
    assert create_backend("TORCH_SDPA", {"kernel": None}).kernel == "auto"  # None: unset


# ---- the problem a backend is judged on ---------------------------------------------------------------------

@pytest.mark.parametrize("resolve", [resolve_backend, auto_backend])
@pytest.mark.parametrize(
    "bad,error,needle",
    [
        ({"dtype": "bfloat16"}, InvalidArgumentType, "dtype='bfloat16' must be a torch.dtype"),
        ({"device": "gpu"}, InvalidArgument, "device='gpu' is not a torch device"),
        ({"head_dim": 0}, InvalidArgument, "head_dim=0 must be a positive int"),
        ({"head_dim": 64.0}, InvalidArgument, "head_dim=64.0 must be a positive int"),
        ({"head_dim": True}, InvalidArgument, "head_dim=True must be a positive int"),
    ],
)
def test_problem_that_is_no_attention_problem_is_refused(resolve, bad, error, needle):
    problem = {"device": "cpu", "dtype": torch.float32, "head_dim": 64, **bad}
    with pytest.raises(error, match=re.escape(needle)):
        resolve(**problem)


def test_context_with_a_bad_backend_type_is_refused_on_entry():
    entered = []
    with pytest.raises(InvalidArgumentType, match=r"attention_backend\(\)=5 must be a backend name"):
        with attention_backend(5):
            entered.append(True)
    assert not entered


# ---- standalone attention(): input errors are user errors, before work ----------------------------------------

def _inputs(case):
    q, k, v = qkv()
    return {
        "rank": (q[0], k, v),
        "not a tensor": (q, k.tolist(), v),
        "dtypes": (q, k, v.double()),
        "devices": (q, k.to("meta"), v),
        "k vs v": (q, k, v[:, :2]),
        "heads": (q, k[:, :, :1], v[:, :, :1]),
    }[case]


@pytest.mark.parametrize("case", ["rank", "not a tensor", "dtypes", "devices", "k vs v", "heads"])
def test_bad_tensors_are_user_errors(case, monkeypatch):
    monkeypatch.setattr(TorchSDPABackend, "forward", lambda *a, **kw: pytest.fail("attention ran"))
    with pytest.raises(UserError):
        attention(*_inputs(case), backend="TORCH_SDPA")


@pytest.mark.parametrize(
    "scale,error,needle",
    [
        ("0.5", InvalidArgumentType, "scale='0.5' must be a real number"),
        (True, InvalidArgumentType, "scale=True must be a real number"),
        ([0.5], InvalidArgumentType, "scale=[0.5] must be a real number"),
        (float("nan"), InvalidArgument, "scale=nan must be finite"),
        (float("inf"), InvalidArgument, "scale=inf must be finite"),
    ],
)
def test_bad_scale_is_refused_before_work(scale, error, needle, monkeypatch):
    monkeypatch.setattr(TorchSDPABackend, "forward", lambda *a, **kw: pytest.fail("attention ran"))
    with pytest.raises(error, match=re.escape(needle)):
        attention(*qkv(), scale=scale, backend="TORCH_SDPA")


@pytest.mark.parametrize("scale", [0.3, 2, np.float32(0.3), torch.tensor(0.3), -0.5, 0.0])
@pytest.mark.parametrize("sq,skv", [(1, 1), (1, 7), (67, 13)])
def test_accepted_scales_are_honoured(scale, sq, skv):
    q, k, v = qkv(sq=sq, skv=skv, d=12)
    out = attention(q, k, v, scale=scale, backend="TORCH_SDPA")
    ref = reference(q, k, v, float(scale))
    assert float((out.double() - ref).abs().max()) <= 1e-5 * max(1.0, float(ref.abs().max()))


def test_default_scale_is_one_over_sqrt_head_dim():
    q, k, v = qkv(sq=65, skv=1, d=20)
    out = attention(q, k, v)
    assert float((out.double() - reference(q, k, v, 1 / math.sqrt(20))).abs().max()) <= 1e-5


def test_sparse_backend_misuse_is_a_user_error():
    with pytest.raises(InvalidArgument, match="SLIDING_TILE_ATTN is a sparse video backend"):
        attention(*qkv(sq=4, skv=4), backend="SLIDING_TILE_ATTN")
    with pytest.raises(InvalidArgument, match="cross-attention needs a dense backend"):
        AttentionDispatch(create_backend("TORCH_SDPA"), create_backend("VIDEO_SPARSE_ATTN"))


# ---- names other libraries use --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name,needle",
    [
        ("SAGE_ATTN_THREE", "SageAttention 3 (FP4) is not implemented"),
        ("VMOBA_ATTN", "VMoBA is not implemented"),
        ("native", "'native' (PyTorch SDPA) is TORCH_SDPA"),
        ("_native_cudnn", 'TORCH_SDPA with attention_config {"kernel": "cudnn"}'),
        ("flash", "'flash' (FlashAttention 2) is FLASH_ATTN"),
        ("flash-attn", "did you mean FLASH_ATTN"),
        (" Torch SDPA ", "did you mean TORCH_SDPA"),
    ],
)
def test_other_libraries_names_point_to_the_backend(name, needle):
    with pytest.raises(InvalidArgument) as e:
        resolve_backend(name, device="cpu", dtype=torch.float32, head_dim=64, env={})
    assert needle in str(e.value) and repr(name) in str(e.value) and "valid names: TORCH_SDPA" in str(e.value)
    with pytest.raises(InvalidArgument) as e:  # the same from FastVideo's variable, which the message names
        resolve_backend(None, device="cpu", dtype=torch.float32, head_dim=64,
                        env={"FASTVIDEO_ATTENTION_BACKEND": name})
    assert needle in str(e.value) and "FASTVIDEO_ATTENTION_BACKEND" in str(e.value)


@pytest.mark.parametrize("name", sorted(OTHER_NAMES))
def test_every_pointer_names_a_registered_backend_and_a_config_it_takes(name):
    assert name not in BACKENDS
    hint = OTHER_NAMES[name]
    named = [w for w in re.findall(r"\b[A-Z][A-Z_]+[A-Z]\b", hint) if w.endswith("_ATTN") or w == "TORCH_SDPA"]
    assert all(n in BACKENDS for n in named), hint
    for backend, config in re.findall(r"([A-Z_]+) with attention_config (\{[^}]*\})", hint):
        assert create_backend(backend, json.loads(config)).name == backend
