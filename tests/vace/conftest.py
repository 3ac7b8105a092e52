import pytest

from fastwan.checkpoint.tiny import VACE_VARIANTS, write_tiny_checkpoint


@pytest.fixture(scope="session")
def vace_ckpts(tmp_path_factory):
    """Tiny random WanVACEPipeline checkpoints written by diffusers: Wan2.1-VACE (one DiT) and Wan2.2-VACE-Fun-A14B
    (two experts), written once per test session."""
    root = tmp_path_factory.mktemp("tiny-vace")
    return {v: write_tiny_checkpoint(root / v, v, seed=40 + i) for i, v in enumerate(VACE_VARIANTS)}
