import pytest

from fastwan.testing import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory):
    """Tiny random Diffusers-layout checkpoints of the three variants (written once per test session)."""
    root = tmp_path_factory.mktemp("tiny")
    return {v: write_tiny_checkpoint(root / v, v, seed=i) for i, v in
            enumerate(("wan2.1", "wan2.2-a14b", "wan2.2-ti2v"))}
