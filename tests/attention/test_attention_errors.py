"""Resolution errors and capability reasons. GPUs are faked by monkeypatching torch.cuda / package probes:
what is tested is the capability -> reason logic, never a kernel."""
from __future__ import annotations

import logging

import pytest
import torch

from fastwan.attention import (
    BackendUnavailableError,
    Capabilities,
    attention,
    attention_backend,
    reasons_cannot_run,
    resolve_backend,
)
from fastwan.attention.backends import packages
from fastwan.errors import InvalidArgument
from fastwan.attention.backends.flash import FlashAttnBackend
from fastwan.attention.registry import requested_backend
from fastwan.attention.backends.sage import SageAttnBackend
from fastwan.attention.backends.sdpa import TorchSDPABackend

BF16 = torch.bfloat16


# ---- names ------------------------------------------------------------------------------------------------

def test_unknown_name_argument_lists_valid_names():
    with pytest.raises(ValueError) as e:
        resolve_backend("FLASHY", device="cpu", dtype=BF16, head_dim=128)
    msg = str(e.value)
    assert "'FLASHY'" in msg and "TORCH_SDPA" in msg and "FLASH_ATTN" in msg and "SAGE_ATTN" in msg


@pytest.mark.parametrize("var", ["FASTVIDEO_ATTENTION_BACKEND", "FASTWAN_ATTENTION_BACKEND"])
def test_unknown_name_from_env_names_the_variable(var):
    with pytest.raises(ValueError) as e:
        resolve_backend(None, device="cpu", dtype=BF16, head_dim=128, env={var: "nonsense"})
    assert f"'nonsense' (from {var})" in str(e.value)  # the value as the user set it, and where
    assert "TORCH_SDPA" in str(e.value)


@pytest.mark.parametrize("var", ["FASTVIDEO_ATTENTION_BACKEND", "FASTWAN_ATTENTION_BACKEND"])
def test_env_backend_is_honoured(var, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="fastwan.attention")
    b = resolve_backend(None, device="cpu", dtype=BF16, head_dim=128, env={var: "torch_sdpa"})
    assert b.name == "TORCH_SDPA"
    assert f"requested by {var}" in caplog.text
    monkeypatch.setenv(var, "TORCH_SDPA")  # the process environment too
    assert requested_backend()[0] == "TORCH_SDPA"


@pytest.mark.parametrize("requested", ["TORCH_SDPA", None])
def test_nvfp4_variable_with_another_backend_is_an_error(requested):
    env = {"FASTWAN_NVFP4_FA4": "1", "FASTVIDEO_ATTENTION_BACKEND": "TORCH_SDPA"}
    with pytest.raises(InvalidArgument, match="NVFP4 .*TORCH_SDPA was requested by"):
        resolve_backend(requested, device="cpu", dtype=BF16, head_dim=128, env=env)


def test_env_variables_that_disagree_are_an_error():
    env = {"FASTVIDEO_ATTENTION_BACKEND": "TORCH_SDPA", "FASTWAN_ATTENTION_BACKEND": "FLASH_ATTN"}
    with pytest.raises(ValueError, match="disagree"):
        resolve_backend(None, device="cpu", dtype=BF16, head_dim=128, env=env)


def test_explicit_argument_beats_context_beats_env():
    env = {"FASTWAN_ATTENTION_BACKEND": "FLASH_ATTN"}
    with attention_backend("TORCH_SDPA"):
        assert resolve_backend(None, device="cpu", dtype=BF16, head_dim=128, env=env).name == "TORCH_SDPA"
    with pytest.raises(BackendUnavailableError):  # the env choice applies outside the context
        resolve_backend(None, device="cpu", dtype=BF16, head_dim=128, env=env)


# ---- explicit but unavailable -----------------------------------------------------------------------------

def test_flash_attn_on_cpu_states_the_device_and_keeps_every_reason_with_install_commands(no_packages):
    with pytest.raises(BackendUnavailableError) as e:
        resolve_backend("FLASH_ATTN", device="cpu", dtype=BF16, head_dim=128, env={})
    msg, reasons = str(e.value), e.value.reasons
    assert "FLASH_ATTN" in msg and "requested by attention_backend= (CLI --attention-backend)" in msg
    assert "device type 'cpu' is not supported (needs cuda) (+3 more: see 'fastwan env')" in msg  # the main one
    assert "\n" not in msg and "pip install" not in msg  # installing a package does not make it run on a CPU
    assert reasons[0] == "device type 'cpu' is not supported (needs cuda)" and len(reasons) == 4  # + FA4, FA3, FA2
    text = "\n".join(reasons)
    assert "pip install flash-attn-4" in text and "pip install flash-attn " in text and "hopper/" in text


# A configuration of each registered backend that cannot run on the CPU (None: the backend as registered).
CPU_REFUSED = {"TORCH_SDPA": {"kernel": "cudnn"}, "FLASH_ATTN": None, "SAGE_ATTN": None,
               "SLIDING_TILE_ATTN": {"kernel": "fa4"}, "VIDEO_SPARSE_ATTN": {"kernel": "fa4"},
               "NEIGHBORHOOD_ATTN": {"kernel": "fa4"}, "ATTN_8BIT": None}


def test_every_registered_backend_has_a_cpu_refusal_case():
    from fastwan.attention.registry import BACKENDS

    assert set(CPU_REFUSED) == set(BACKENDS)


def _runs(name, config, dtype):
    try:
        resolve_backend(name, device="cpu", dtype=dtype, head_dim=64, config=config, env={})
    except BackendUnavailableError:
        return False
    return True


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("name", sorted(CPU_REFUSED))
def test_an_unavailable_backend_is_one_short_line_whose_fix_runs_here(name, dtype):
    from fastwan.attention.registry import BACKENDS

    config = CPU_REFUSED[name]
    with pytest.raises(BackendUnavailableError) as e:
        resolve_backend(name, device="cpu", dtype=dtype, head_dim=64, config=config, env={})
    msg = str(e.value)
    assert len(msg) <= 300 and "\n" not in msg, msg
    assert msg.startswith(f"Attention backend {name} ") and msg.count(name) == 1, msg  # never suggested itself
    assert e.value.reasons and e.value.reasons[0] in msg  # the main reason
    suggested = [n for n in BACKENDS if n != name and n in msg]
    assert all(_runs(n, None, dtype) for n in suggested), msg
    if config is not None and _runs(name, None, dtype):
        assert f"Drop the attention config ({', '.join(config)})" in msg, msg
    else:
        assert suggested, msg


def test_sage_attn_on_cpu_states_the_device_and_keeps_the_install_command(no_packages):
    with pytest.raises(BackendUnavailableError) as e:
        resolve_backend("SAGE_ATTN", device="cpu", dtype=BF16, head_dim=128, env={})
    assert "device type 'cpu'" in str(e.value)
    assert "pip install sageattention==1.0.6" in "\n".join(e.value.reasons)


def test_explicit_unavailable_via_env_names_the_variable(no_packages):
    with pytest.raises(BackendUnavailableError, match="requested by FASTVIDEO_ATTENTION_BACKEND"):
        resolve_backend(None, device="cpu", dtype=BF16, head_dim=128, env={"FASTVIDEO_ATTENTION_BACKEND": "SAGE_ATTN"})


# ---- tensor validation --------------------------------------------------------------------------------------

def test_wrong_rank():
    x = torch.randn(2, 8, 64)
    with pytest.raises(ValueError, match=r"rank 3.*\[B, S, H, D\]"):
        attention(x, x, x, backend="TORCH_SDPA")


def test_dtype_mismatch():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match="dtypes differ"):
        attention(q, q.double(), q, backend="TORCH_SDPA")


def test_mixed_devices():
    q = torch.randn(1, 4, 2, 8)
    k = torch.empty(1, 4, 2, 8, device="meta")
    with pytest.raises(ValueError, match="different devices"):
        attention(q, k, q, backend="TORCH_SDPA")


def test_shape_mismatch():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="must agree on batch, heads and head dim"):
        attention(q, torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8), backend="TORCH_SDPA")


# ---- capability -> reason logic -------------------------------------------------------------------------------

def test_reasons_cannot_run_from_fake_capabilities(fake_gpu):
    fake_gpu(cc=(8, 6))
    caps = Capabilities(
        device_types=("cuda",), dtypes=(torch.float16,), head_dims=(64, 128), min_compute_capability=(9, 0),
        packages=(("surely_not_a_real_package_xyz", "pip install xyz"),),
    )
    reasons = reasons_cannot_run(caps, device="cuda", dtype=torch.float32, head_dim=96)
    text = "\n".join(reasons)
    assert "pip install xyz" in text
    assert "sm86 is below the minimum sm90" in text
    assert "dtype float32 is not supported" in text
    assert "head dim 96 is not supported (needs one of [64, 128])" in text
    # the device's reason first: no package makes a CUDA backend run on a CPU
    assert reasons_cannot_run(caps, device="cpu", dtype=torch.float16, head_dim=64)[0].startswith("device type 'cpu'")


def test_flash_head_dim_512_reason(fake_gpu):
    fake_gpu(cc=(9, 0), fa={4})
    reasons = FlashAttnBackend().reasons(device="cuda", dtype=BF16, head_dim=512)
    text = "\n".join(reasons)
    assert "head dim 512 exceeds the maximum 256" in text
    assert "FA4 on sm90 needs a head dim between 8 and 256 and a multiple of 8; got 512" in text


def test_flash_fa4_on_blackwell_rejects_head_dim_192_without_fa2(fake_gpu):
    fake_gpu(cc=(10, 0), fa={4})
    text = "\n".join(FlashAttnBackend().reasons(device="cuda", dtype=BF16, head_dim=192))
    assert "FA4 on sm100 needs a head dim between 8 and 128" in text and "[256]" in text
    assert "pip install flash-attn " in text  # FA2 (which would take 192) is not installed: say how to get it


@pytest.mark.parametrize(
    "cc,installed,expected",
    [
        ((9, 0), {2, 3, 4}, "flash_attn.cute FA4 (sm90)"),  # measured on sm90 before the unmeasured FA3
        ((9, 0), {2, 3}, "flash_attn_interface FA3 (sm90)"),
        ((9, 0), {2, 4}, "flash_attn.cute FA4 (sm90)"),
        ((9, 0), {2}, "flash_attn FA2 (sm90)"),
        ((10, 0), {2, 3, 4}, "flash_attn.cute FA4 (sm100)"),
        ((10, 3), {2, 3}, "flash_attn FA2 (sm103)"),
        ((8, 0), {2, 3, 4}, "flash_attn FA2 (sm80)"),
        ((8, 9), {2, 4}, "flash_attn FA2 (sm89)"),
    ],
)
def test_flash_picks_best_installed_for_the_device(fake_gpu, cc, installed, expected):
    fake_gpu(cc=cc, fa=installed)
    b = FlashAttnBackend(version=None)
    assert b.reasons(device="cuda", dtype=BF16, head_dim=128) == []
    assert b.kernel_name("cuda") == expected


def test_installed_but_broken_package_is_a_reason(fake_gpu, monkeypatch, caplog):
    fake_gpu(cc=(9, 0), fa={3, 4}, sage=1)
    monkeypatch.setattr(packages, "flash_import_error", lambda v: "ImportError: undefined symbol" if v == 4 else None)
    b = FlashAttnBackend()
    with caplog.at_level(logging.WARNING, logger="fastwan.attention"):
        assert b.reasons(device="cuda", dtype=BF16, head_dim=128) == []
    assert b.kernel_name("cuda") == "flash_attn_interface FA3 (sm90)"  # the next generation, and a warning says why
    assert "FA4 is installed but does not import (ImportError: undefined symbol)" in caplog.text
    text = "\n".join(FlashAttnBackend(version=4).reasons(device="cuda", dtype=BF16, head_dim=128))
    assert "FA4 is installed but does not import" in text
    monkeypatch.setattr(packages, "sage_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    text = "\n".join(SageAttnBackend().reasons(device="cuda", dtype=BF16, head_dim=128))
    assert "sageattention is installed but does not import (ModuleNotFoundError" in text


def test_flash_pick_is_cached_per_device_and_head_dim(fake_gpu):
    fake_gpu(cc=(10, 0), fa={2, 4})
    b = FlashAttnBackend()
    assert b.reasons(device="cuda", dtype=BF16, head_dim=128) == []
    assert b.reasons(device="cuda:0", dtype=BF16, head_dim=192) == []  # FA4 on sm100 stops at 128: FA2
    assert b._picked == {(0, 128): 4, (0, 192): 2}
    assert b._version_for(torch.device("cuda", 0), 128) == 4
    assert b._version_for(torch.device("cuda", 0), 192) == 2
    assert b.kernel_name("cuda") == "flash_attn.cute FA4 (sm100)"


def test_flash_pinned_version_unavailable_is_a_reason_not_a_switch(fake_gpu, monkeypatch):
    fake_gpu(cc=(9, 0), fa={2, 4})
    monkeypatch.setenv("FASTWAN_FLASH_ATTN_VERSION", "3")
    b = FlashAttnBackend()
    assert b.version == 3
    text = "\n".join(b.reasons(device="cuda", dtype=BF16, head_dim=128))
    assert "FA3 (flash_attn_interface) is not installed" in text and "cd hopper" in text
    fake_gpu(cc=(8, 0), fa={2, 3, 4})
    text = "\n".join(FlashAttnBackend(version=4).reasons(device="cuda", dtype=BF16, head_dim=128))
    assert "FA4 supports sm90, sm100, sm103, sm110; this GPU is sm80" in text
    assert FlashAttnBackend(version=4).kernel_name("cuda") == "FLASH_ATTN (FA4 pinned, unavailable on sm80)"


def test_flash_version_argument_is_validated():
    with pytest.raises(ValueError, match="version=5 is not 2, 3 or 4"):
        FlashAttnBackend(version=5)
    assert FlashAttnBackend(version="2").version == 2


def test_flash_dtype_reason(fake_gpu):
    text = "\n".join(FlashAttnBackend().reasons(device="cuda", dtype=torch.float32, head_dim=128))
    assert "dtype float32 is not supported (needs one of float16, bfloat16)" in text


NVFP4_MSG = "NVFP4 attention needs sm100/sm103 (Blackwell) and a flash-attn build with NVFP4 Q/K; this device is"


def test_nvfp4_refused_off_blackwell(fake_gpu, monkeypatch):
    fake_gpu(cc=(9, 0), fa={4})
    text = "\n".join(FlashAttnBackend(nvfp4=True).reasons(device="cuda", dtype=BF16, head_dim=128))
    assert f"{NVFP4_MSG} sm90" in text
    monkeypatch.setenv("FASTVIDEO_NVFP4_FA4", "1")
    assert FlashAttnBackend().nvfp4 is True
    assert f"{NVFP4_MSG} cpu" in "\n".join(FlashAttnBackend().reasons(device="cpu", dtype=BF16, head_dim=128))


def test_nvfp4_on_blackwell_needs_the_fp4_kernel(fake_gpu, monkeypatch):
    fake_gpu(cc=(10, 0), fa={4})
    monkeypatch.setattr(packages, "fa4_accepts_nvfp4", lambda: (False, "flash_attn.cute.flash_attn_func has no mSFQ"))
    text = "\n".join(FlashAttnBackend(nvfp4=True).reasons(device="cuda", dtype=BF16, head_dim=128))
    assert f"{NVFP4_MSG} sm100 (flash_attn.cute.flash_attn_func has no mSFQ" in text
    # a build that does have it: no reason, and the kernel name says what would run
    monkeypatch.setattr(packages, "fa4_accepts_nvfp4", lambda: (True, "ok"))
    b = FlashAttnBackend(nvfp4=True)
    assert b.reasons(device="cuda", dtype=BF16, head_dim=128) == []
    assert b.kernel_name("cuda") == "flash_attn.cute FA4 NVFP4 Q/K (sm100)"
    assert "head dims [128]" in "\n".join(b.reasons(device="cuda", dtype=BF16, head_dim=64))
    pinned = FlashAttnBackend(version=2, nvfp4=True)
    assert "version=2" in "\n".join(pinned.reasons(device="cuda", dtype=BF16, head_dim=128))


def test_fa4_nvfp4_feature_check_without_the_package(monkeypatch):
    monkeypatch.setattr(packages, "flash_installed", lambda v: False)
    assert packages.fa4_accepts_nvfp4() == (False, "flash_attn.cute is not installed")


def test_sage_arch_and_head_dim_reasons(fake_gpu):
    fake_gpu(cc=(10, 0), sage=1)
    text = "\n".join(SageAttnBackend().reasons(device="cuda", dtype=BF16, head_dim=128))
    assert "sageattention 1.x: compute capability sm100 is not one of sm80, sm86, sm89, sm90" in text
    fake_gpu(cc=(9, 0))
    assert SageAttnBackend().reasons(device="cuda", dtype=BF16, head_dim=128) == []
    assert SageAttnBackend().kernel_name("cuda") == "sageattention 1.0.6 sageattn (Triton INT8 QK, fp16 PV)"
    text = "\n".join(SageAttnBackend().reasons(device="cuda", dtype=BF16, head_dim=80))
    assert "head dim 80 is not supported (needs one of [64, 96, 128])" in text
    fake_gpu(cc=(12, 0), sage=2)
    assert SageAttnBackend().reasons(device="cuda", dtype=BF16, head_dim=80) == []
    assert "exceeds the maximum 128" in "\n".join(SageAttnBackend().reasons(device="cuda", dtype=BF16, head_dim=256))


def test_sdpa_pinned_kernels_give_reasons_on_unsuitable_gpus(fake_gpu):
    fake_gpu(cc=(7, 5))
    text = "\n".join(TorchSDPABackend("flash").reasons(device="cuda", dtype=BF16, head_dim=128))
    assert "SDPA kernel 'flash': compute capability sm75 is below the minimum sm80" in text
    text = "\n".join(TorchSDPABackend("cudnn").reasons(device="cuda", dtype=torch.float32, head_dim=512))
    assert "dtype float32" in text and "head dim 512 exceeds the maximum 256" in text
    with pytest.raises(ValueError, match="SDPA kernel 'fastest' is unknown"):
        TorchSDPABackend("fastest")


# ---- automatic mode, scoping --------------------------------------------------------------------------------

def test_auto_mode_logs_choice_and_skips(caplog, no_packages):
    caplog.set_level(logging.DEBUG, logger="fastwan.attention")
    b = resolve_backend(None, device="cpu", dtype=BF16, head_dim=128, env={})
    assert b.name == "TORCH_SDPA"
    skips = [r for r in caplog.records if "skip FLASH_ATTN" in r.getMessage()]
    assert skips and skips[0].levelno == logging.DEBUG and "pip install flash-attn-4" in skips[0].getMessage()
    chosen = [r for r in caplog.records if "chosen automatically" in r.getMessage()]
    assert chosen and chosen[0].levelno == logging.INFO and "TORCH_SDPA" in chosen[0].getMessage()


@pytest.mark.parametrize(
    "cc,installed,auto_kernel",
    [
        ((9, 0), {2, 3, 4}, "FLASH_ATTN"),  # FA4 on sm90 is the measured kernel
        ((9, 0), {3}, "TORCH_SDPA"),  # FA3 never ran on a GPU here: automatic selection passes it over
        ((9, 0), {2}, "TORCH_SDPA"),
        ((10, 0), {4}, "TORCH_SDPA"),  # FA4 on Blackwell: not measured by fastwan
    ],
)
def test_auto_mode_picks_only_verified_kernels(fake_gpu, caplog, cc, installed, auto_kernel):
    fake_gpu(cc=cc, fa=installed)
    caplog.set_level(logging.DEBUG, logger="fastwan.attention")
    b = resolve_backend(None, device="cuda", dtype=BF16, head_dim=128, env={})
    assert b.name == auto_kernel
    if auto_kernel == "TORCH_SDPA":
        skip = [r.getMessage() for r in caplog.records if "skip FLASH_ATTN" in r.getMessage()]
        assert skip and "unverified" in skip[0] and "ask for it by name" in skip[0]


def test_explicit_unverified_kernel_runs_with_a_warning(fake_gpu, caplog):
    fake_gpu(cc=(9, 0), fa={3})
    with caplog.at_level(logging.WARNING, logger="fastwan.attention"):
        b = resolve_backend("FLASH_ATTN", device="cuda", dtype=BF16, head_dim=128, env={})
    assert b.kernel_name("cuda") == "flash_attn_interface FA3 (sm90)"
    assert "unverified" in caplog.text and "FA3 has not been run by fastwan on sm90" in caplog.text
    fake_gpu(fa={4})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastwan.attention"):
        resolve_backend("FLASH_ATTN", device="cuda", dtype=BF16, head_dim=128, env={})
    assert "unverified" not in caplog.text


def test_sage_two_is_unverified_one_is_not(fake_gpu):
    fake_gpu(cc=(9, 0), sage=1)
    assert SageAttnBackend().unverified("cuda", 128) is None
    fake_gpu(sage=2)
    assert "sageattention 2.x has not been run by fastwan on sm90" in SageAttnBackend().unverified("cuda", 128)


def test_env_report_marks_unverified_backends(fake_gpu):
    from fastwan.envinfo import backend_rows

    fake_gpu(cc=(9, 0), fa={3})
    rows = {r["backend"]: r for r in backend_rows(torch.device("cuda"), BF16, 128)}
    flash = next(r for k, r in rows.items() if k.startswith("FLASH_ATTN"))
    assert flash["available"] and "FA3 has not been run" in flash["unverified"]
    sdpa = next(r for k, r in rows.items() if k.startswith("TORCH_SDPA"))
    assert sdpa["unverified"] is None


def test_context_manager_scopes_and_restores():
    assert requested_backend(env={})[1] == "automatic"
    with attention_backend("TORCH_SDPA"):
        assert requested_backend(env={}) == ("TORCH_SDPA", "attention_backend() context")
        with attention_backend("FLASH_ATTN"):
            assert requested_backend(env={})[0] == "FLASH_ATTN"
        assert requested_backend(env={})[0] == "TORCH_SDPA"
        with pytest.raises(RuntimeError), attention_backend("SAGE_ATTN"):
            raise RuntimeError("boom")
        assert requested_backend(env={})[0] == "TORCH_SDPA"
    assert requested_backend(env={}) == (None, "automatic")
    with pytest.raises(ValueError, match="valid names"), attention_backend("NOT_A_BACKEND"):
        pass


def test_nvfp4_env_is_an_explicit_request_that_raises_off_blackwell():
    """FASTVIDEO_NVFP4_FA4=1 without a backend name must not fall back to another backend silently."""
    from fastwan.attention import BackendUnavailableError, resolve_backend

    with pytest.raises(BackendUnavailableError, match="FASTVIDEO_NVFP4_FA4"):
        resolve_backend(None, device="cpu", dtype=torch.bfloat16, head_dim=128, env={"FASTVIDEO_NVFP4_FA4": "1"})
