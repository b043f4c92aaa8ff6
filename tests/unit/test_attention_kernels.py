"""The SDPA kernels a run allows (hfpar.train.trainer.attention_kernels): on CUDA everything but cuDNN attention,
whose per-shape execution plans cost seconds each time hfpar's padding-free / packed batches change shape; on CPU
SDPA's own choice. The flags are torch's global backend switches, so this runs on a CPU-only build too."""

from __future__ import annotations

import torch

from hfpar.train.trainer import attention_kernels


def _flags() -> dict:
    b = torch.backends.cuda
    return {
        "cudnn": b.cudnn_sdp_enabled(),
        "flash": b.flash_sdp_enabled(),
        "efficient": b.mem_efficient_sdp_enabled(),
        "math": b.math_sdp_enabled(),
    }


def test_cuda_runs_without_cudnn_attention_and_restores_the_flags():
    before = _flags()
    with attention_kernels(torch.device("cuda", 0)):
        assert _flags() == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    assert _flags() == before


def test_cpu_keeps_sdpas_choice():
    before = _flags()
    with attention_kernels(torch.device("cpu")):
        assert _flags() == before
