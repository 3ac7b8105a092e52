"""FA4 block sparsity runs the head dims dense FA4 runs (flash_attn.cute asserts otherwise): the automatic kernel of
a sparse backend takes flex for any other head dim, and an explicit kernel='fa4' is refused naming the rule. The GPU
is stood in for by its compute capability (the rule is data: ``backends.flash.VARIANTS[4]``)."""
import pytest
import torch

from fastwan.attention.sparse import fa4
from fastwan.attention.sparse.vsa import VideoSparseBackend


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device of compute capability 9.0 where FA4 block sparsity is installed."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4, "fa4_reasons", lambda device, dtype: [])


@pytest.mark.parametrize("head_dim, runs", [(128, True), (64, True), (12, False), (4, False), (264, False)])
def test_fa4_head_dim_rule(hopper, head_dim, runs):
    reason = fa4.head_dim_reason("cuda", head_dim)
    assert (reason is None) == runs, reason
    if not runs:
        assert f"got {head_dim}" in reason and "multiple of 8" in reason


def test_the_automatic_kernel_takes_flex_where_fa4_cannot_run_the_head_dim(hopper):
    backend = VideoSparseBackend()
    assert backend.resolve_kernel("cuda", torch.bfloat16, None, 128) == "fa4"
    assert backend.resolve_kernel("cuda", torch.bfloat16, None, 12) == "flex-compiled"


def test_an_explicit_fa4_kernel_names_the_head_dim_rule(hopper):
    backend = VideoSparseBackend(kernel="fa4")
    reasons = backend.reasons(device="cuda", dtype=torch.bfloat16, head_dim=12)
    assert any("kernel 'fa4': FA4 needs a head dim" in r and "got 12" in r for r in reasons), reasons
    assert not any("FA4 needs a head dim" in r for r in backend.reasons(device="cuda", dtype=torch.bfloat16,
                                                                         head_dim=128))
