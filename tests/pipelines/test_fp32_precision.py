"""fp32_precision: a CUDA load sets torch's fp32 matmul and convolution math (TF32 by default, full fp32 when
pinned); a bad value is refused naming it; off CUDA nothing changes."""
import pytest
import torch

from fastwan import VideoGenerator
from fastwan.errors import InvalidArgument
from fastwan.pipelines.load_options import LoadOptions
from fastwan.pipelines.setup import set_fp32_precision


@pytest.fixture
def torch_precision():
    """torch's process-wide settings, restored after the test."""
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def settings():
    return torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_a_cuda_load_sets_the_math_of_fp32_matmuls_and_convolutions(torch_precision, precision):
    torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "none"
    set_fp32_precision(torch.device("cuda", 1), precision)
    assert settings() == (precision, precision)


def test_a_cpu_load_changes_nothing(torch_precision, tiny_ckpts):
    torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "none"
    VideoGenerator.from_pretrained(tiny_ckpts["wan2.1"], device="cpu", dtype=torch.float32, fp32_precision="ieee")
    assert settings() == ("none", "none")


def test_the_default_is_tf32_and_a_bad_value_is_refused():
    assert LoadOptions(model="tiny").fp32_precision == "tf32"
    with pytest.raises(InvalidArgument, match=r"fp32_precision='highest'.*'tf32'.*'ieee'"):
        LoadOptions(model="tiny", fp32_precision="highest")
