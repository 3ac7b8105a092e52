"""The GPU benchmarks' CPU-checkable parts: variants derived from DiTOptions, variant parsing, video comparison,
and every benchmark and probe module importing and answering --help."""
import dataclasses
import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import e2e, forward_14b, harness
from fastwan.options import DiTOptions

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# every script with a command line: the benchmarks and the probes (not the helpers they import, nor the A/B worker,
# which is run by path)
HELPER_MODULES = ("__init__", "harness", "checkpoints", "sparse_configs", "ab_worker", "editing_inputs")  # no main
MODULES = sorted(p.relative_to(BENCHMARKS.parent).with_suffix("").as_posix().replace("/", ".")
                 for p in [*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("probes/*.py")]
                 if p.stem not in HELPER_MODULES)


def test_option_variants_follow_the_dataclass():
    named = harness.option_variants("cuda", torch.bfloat16)
    assert named["defaults"] == {}
    for f in dataclasses.fields(DiTOptions):
        default = getattr(DiTOptions(), f.name)
        if isinstance(default, bool):
            assert named[("-" if default else "+") + f.name] == {f.name: not default}
    for label, overrides in named.items():
        assert harness.option_overrides(label) == overrides
        DiTOptions(**overrides)  # valid field names and values


def test_option_variants_drop_names_that_resolve_alike():
    """On CPU "auto" resolves to the reference block, so "reference" is the defaults there; "fast" is not."""
    named = harness.option_variants("cpu", torch.float32)
    assert "reference" not in named and named["fast"] == {"block": "fast"}
    resolved = [DiTOptions(**o).resolve("cpu", torch.float32) for o in named.values()]
    assert len(set(resolved)) == len(resolved)


def test_unknown_dit_variant_is_refused():
    with pytest.raises(ValueError, match="DiT variant 'nope'"):
        harness.option_overrides("nope")


def test_e2e_ab_variants():
    assert "reference" in harness.option_variants()
    assert e2e.parse_ab("sequential") == ("sequential", {})
    assert e2e.parse_ab("batched/reference") == ("batched", {"block": "reference"})
    with pytest.raises(ValueError, match="cfg_mode"):
        e2e.parse_ab("twice")


@pytest.mark.parametrize("argv,msg", [(["--phase", "cfgab", "--ab", "batched/nope"], "DiT variant 'nope'"),
                                      (["--phase", "make,warp"], "unknown phase")])
def test_e2e_refuses_bad_arguments_before_any_work(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        e2e.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_forward_14b_variants():
    assert forward_14b.parse_variant("auto", "FLASH_ATTN") == ({"fa4_tile_m": "auto", "fa4_split": True}, {})
    assert forward_14b.parse_variant("t128/nosplit/reference", "FLASH_ATTN") == (
        {"fa4_tile_m": 128, "fa4_split": False}, {"block": "reference"})
    assert forward_14b.parse_variant("reference", "TORCH_SDPA") == (None, {"block": "reference"})
    with pytest.raises(ValueError, match="need --backend FLASH_ATTN"):
        forward_14b.parse_variant("t192", "TORCH_SDPA")
    with pytest.raises(ValueError, match="part 'fast-ish'"):
        forward_14b.parse_variant("t128/fast-ish", "FLASH_ATTN")


def test_compare_videos(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    assert harness.psnr(a, a) == float("inf") and harness.ssim(a, a) == pytest.approx(1.0)
    b = a.copy()
    b[0, 0, 0, 0] ^= 8
    path = tmp_path / "ref.npy"
    assert harness.compare(a, path) is None
    np.save(path, a)
    got = harness.compare(b, path)
    assert got["max_abs"] == 8 and 0 < got["mean_abs"] < 1 and got["psnr_db"] > 40
    assert harness.compare(a[:1], path) is None  # another shape: no comparison


def test_kernel_classes():
    assert harness.classify("flash_fwd_kernel") == "attention"
    assert harness.classify("nvjet_tst_128x256") == "gemm"
    assert harness.classify("norm_rows") == "norms"
    assert harness.classify("triton_poi_fused_add_0") == "elementwise/other"


def test_modules_found():
    assert {"benchmarks.e2e", "benchmarks.cache_bench", "benchmarks.probes.levers"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_help(name, capsys):
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0 and f"python -m {name}" in capsys.readouterr().out


def test_forward_14b_video_argument():
    assert harness.parse_video("480x832x81") == (480, 832, 81)
    for bad in ("480x832", "480x830x81", "480x832x80", "0x832x81", "axbxc"):
        with pytest.raises(ValueError, match="--video"):
            harness.parse_video(bad)


def test_derived_fastwan_checkpoint_loads_its_gates(tmp_path):
    """derive_fastwan on a single-file DiT: the gates are listed in a shard index, so the loader reads them and
    the checkpoint runs VSA with them (a stray gates file beside the weights would be ignored)."""
    import torch
    from safetensors.torch import load_file

    from benchmarks.checkpoints import derive_fastwan
    from fastwan import VideoGenerator
    from fastwan.checkpoint.tiny import write_tiny_checkpoint

    plain = write_tiny_checkpoint(tmp_path / "plain", "wan2.1")
    derive_fastwan(plain, tmp_path / "fw")
    gen = VideoGenerator.from_pretrained(tmp_path / "fw", device="cpu", dtype=torch.float32)
    assert gen.checkpoint.vsa_gates and gen.attention.self_backend.name == "VIDEO_SPARSE_ATTN"
    gates = load_file(str(tmp_path / "fw" / "transformer" / "gates.safetensors"))
    got = gen.transformers[0].blocks[1].attn1.to_gate_compress.weight
    assert torch.equal(got, gates["blocks.1.to_gate_compress.weight"].float())
