"""hfpar's MoELayer on its GPU code path (the fused grouped GEMM, which torch >= 2.10 also runs on CPU in fp32).

- Forward and backward dispatch no op that makes the host wait for the device on CUDA (tests/helpers/host_syncs.py):
  rows per expert come from the sorted expert ids, not torch.bincount, whose CUDA kernel reads the largest id on the
  host (one sync per MoE layer and step: the 1.11x of benchmarks/results/gpu/round/call2/moe/gpu.md had one).
- With the capacity factor the capacity itself is a host number (documented), so only the dropless layer is held
  to zero.
- In bf16, the HF blocks hfpar converts route like the HF block: the router's logits in the weights' dtype, as HF's
  routers compute them (hfpar's router was fp32, 0.8e-3 to 3.7e-3 from the HF block's output; now 0 where the HF
  router also hands the experts bf16 weights).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from benchmarks.tensor_parallel.family_sweep import tiny_config
from hfpar.parallel.expert_parallel.apply import _probe
from hfpar.parallel.expert_parallel.families import find_moe_blocks
from hfpar.parallel.expert_parallel.moe import sorted_counts
from tests.helpers.host_syncs import HostSyncs
from tests.helpers.moe_layers import TOL, grad_scale, make_moe

pytestmark = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without F.grouped_mm on CPU")


def _step(layer, x, mask=None):
    y = layer(x, token_mask=mask)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y


@pytest.mark.parametrize("shared, aux", [(False, 0.0), (True, 0.05)])
def test_moe_layer_reads_nothing_on_the_host(shared, aux):
    layer = make_moe(E=8, H=16, I=8, k=2, shared=shared, aux=aux, z=aux)
    layer.experts.backend = "grouped_mm"
    x = torch.randn(2, 12, 16, requires_grad=True)
    mask = torch.ones(2, 12)
    mask[1, 9:] = 0  # padding: left out of the router's statistics
    with grad_scale(1.0), HostSyncs() as seen:
        y = _step(layer, x, mask)
    assert seen.ops == []
    # the same training as the CPU kernel's path, which reads the counts on the host by design
    ref = make_moe(E=8, H=16, I=8, k=2, shared=shared, aux=aux, z=aux)
    ref.experts.backend = "grouped_linear"
    x2 = x.detach().clone().requires_grad_()
    with grad_scale(1.0), HostSyncs() as seen_cpu_kernel:
        y2 = _step(ref, x2, mask)
    assert "Tensor.tolist" in seen_cpu_kernel.ops  # the census sees a host read
    torch.testing.assert_close(y, y2, **TOL)
    torch.testing.assert_close(x.grad, x2.grad, **TOL)
    for (name, p), p2 in zip(layer.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p2.grad, **TOL, msg=name)


def test_sorted_counts_is_bincount_without_the_read():
    ids = torch.tensor([0, 0, 2, 2, 2, 5, 7, 7, 8, 8])  # 8 = a dropped / padding copy (id E)
    torch.testing.assert_close(sorted_counts(ids, 8), torch.bincount(ids, minlength=9)[:8])
    assert sorted_counts(torch.zeros(0, dtype=torch.long), 3).tolist() == [0, 0, 0]
    with HostSyncs() as seen:
        sorted_counts(ids, 8)
    assert seen.ops == []


@pytest.mark.parametrize(
    "model_type", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "granitemoe", "qwen3_next", "flex_olmo", "minimax"]
)
def test_bf16_blocks_route_like_the_hf_block(model_type):
    """Converted at ep = 1 on the same tensors, in bf16: hfpar's block output vs the HF block's (`_probe`, the
    relative norm of the difference). Where the HF router hands its experts bf16 weights the two are the same
    computation; where it keeps them fp32 (Mixtral, MiniMax) the experts' weighting rounds differently (bf16 eps)."""
    cfg = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    blocks, problems = find_moe_blocks(model, lambda *a: _probe(cfg, *a))
    assert blocks and not problems
    for b in blocks:
        router = getattr(b.module, b.fam.router)
        scores = router(torch.randn(4, cfg.hidden_size, dtype=torch.bfloat16))[1]
        diff = _probe(cfg, b.module, b.fam, b.E, b.k)
        assert diff == 0.0 if scores.dtype == torch.bfloat16 else diff < 5e-3, (b.path, scores.dtype, diff)
