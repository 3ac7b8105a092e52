from dataclasses import dataclass
from pathlib import Path

import pytest

from fastwan.checkpoint.tiny import write_generator_file, write_tiny_checkpoint


@dataclass(frozen=True)
class TinyCausal:
    """Tiny causal checkpoints of every layout fastwan loads (written once per test session).

    ``fastvideo``: FastVideo's Diffusers layout (``WanCausalDMDPipeline``; loads alone). ``base``: a tiny Wan2.1
    text-to-video checkpoint, the base the generator files load over (``causal_weights=``). ``self_forcing``: a pickle
    as Self-Forcing releases (``generator``, ``generator_ema``, ``critic``; ``model.`` + original Wan names; needs
    ``allow_pickle=True``); ``causvid``: a pickle as CausVid releases (``generator`` alone); ``flat``: one flat
    ``.safetensors`` state dict under ``model.`` + original names (loads without pickle)."""

    fastvideo: Path
    base: Path
    self_forcing: Path
    causvid: Path
    flat: Path


@pytest.fixture(scope="session")
def tiny_causal(tmp_path_factory):
    root = tmp_path_factory.mktemp("causal")
    base = write_tiny_checkpoint(root / "base", "wan2.1", seed=3)
    return TinyCausal(fastvideo=write_tiny_checkpoint(root / "sfwan", "sfwan2.1", seed=4), base=base,
                      self_forcing=write_generator_file(root / "self_forcing_dmd.pt", base, seed=5),
                      causvid=write_generator_file(root / "model.pt", base, entries=("generator",), seed=6),
                      flat=write_generator_file(root / "generator.safetensors", base, entries=(), seed=7))
