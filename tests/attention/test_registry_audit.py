"""Backend selection audit: every bad request is a user error raised before work (naming the value, the rule and
the fix), never a raw exception from torch or a setting silently read as something else. GPUs are faked
(tests/attention/conftest.py); what runs is the CPU SDPA path, checked against a float64 computation."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from fastwan.attention import (
    AttentionDispatch,
    BackendUnavailableError,
    attention,
    attention_backend,
    auto_backend,
    create_backend,
    resolve_backend,
)
from fastwan.attention.backends.sdpa import TorchSDPABackend
from fastwan.attention.registry import BACKENDS, OTHER_NAMES
from fastwan.errors import InvalidArgument, InvalidArgumentType, UserError

BF16 = torch.bfloat16


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
