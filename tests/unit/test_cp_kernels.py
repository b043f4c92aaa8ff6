"""The CUDA kernel calls' inputs that a CPU can check (hfpar/parallel/context_parallel/kernels.py): the efficient
kernel's bias rows 16-byte aligned whatever the block width, and which blocks run in fp32. The calls themselves
need a GPU: benchmarks/context_parallel/gpu_attention.py (committed H200 run:
benchmarks/results/context_parallel/gpu_attention.md)."""

import pytest
import torch

from hfpar.parallel.context_parallel.kernels import _cuda_bias, _half_masked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tk", [1, 34, 98, 199, 256])
def test_bias_rows_are_aligned_and_mask_exactly(dtype, tk):
    # an H200 refused the unpadded bias: "attn_bias.stride(2) = 199, and should be a multiple of 4"
    mask = torch.rand(37, tk, generator=torch.Generator().manual_seed(tk)) > 0.4
    q = torch.zeros(2, 4, 37, 8, dtype=dtype)
    bias = _cuda_bias(mask, q)
    assert bias.shape == (2, 4, 37, tk) and bias.dtype == dtype
    assert bias.stride(2) % 16 == 0 and bias.stride(3) == 1
    assert torch.equal(bias[1, 3] == 0, mask) and bool(torch.isneginf(bias[0, 0][~mask]).all())


def test_half_precision_window_blocks_run_in_fp32():
    mask = torch.ones(2, 2, dtype=torch.bool)
    assert _half_masked(torch.zeros(1, dtype=torch.bfloat16), mask)
    assert _half_masked(torch.zeros(1, dtype=torch.float16), mask)
    assert not _half_masked(torch.zeros(1, dtype=torch.float32), mask)
    assert not _half_masked(torch.zeros(1, dtype=torch.bfloat16), None)
