"""A representative subset of the EP family sweep (benchmarks/moe/ep_family_sweep.py runs every MoE causal-LM type): a
tiny model of each, EP=2 against the unsharded model in a plain loop (each rank's loss with the HF aux loss
(output_router_logits on) and every gradient after the data-parallel reduction, one SGD step, again; float32, within
1e-4), on 2 gloo ranks (one spawn). Each converted block first passed its own equality check against the HF block.
Families whose blocks keep their own HF code, only the experts sharded (hfpar.parallel.expert_parallel.hf_experts):

    deepseek_v3     sigmoid scores, e_score_correction_bias, group-limited top-k, routed scaling, shared experts,
                    dense first layer (the routing of Kimi-K2, GLM-4.5-MoE, DeepSeek-V3.x)
    gpt_oss         transposed experts with biases, interleaved clamped SwiGLU, a router with a bias
    ernie4_5_moe    moe_statics.e_score_correction_bias, shared experts
    phimoe          sparsemixer routing
    glm4_moe        DeepSeek-V3-style routing in GLM's block
    llama4_text     dense experts input (every token for every expert, scaled by its sigmoid score)
    lfm2_moe        the block's own expert_bias (drawn at random by the sweep, as every routing-correction buffer)
    kimi_linear     linear-attention hybrid, DeepSeek-V3-style routing
    dbrx            experts stacked as 2-D row blocks (E * F, H) in a child GLU module, rows handed unflattened
    longcat_flash   zero-computation experts: routed indices E .. E + Z - 1 run no weights (identity), gate_up_proj
                    holds E + Z rows, down_proj E; its forward cannot take one choice per row (squeeze)
and refused in one line naming the module: jetmoe (experts split into two modules called with per-expert counts).
Plus the check's sensitivity: a block whose experts weight their input (not their output), row-block experts
holding a shared matrix whose dim 0 also divides by E, and zero-computation experts computed wrongly where the
token is (which the tiny LongCat-Flash's routing, dominated by its correction bias, never picks: the check's direct
call of the experts module reaches every expert) are refused, not sharded.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from benchmarks.moe.ep_family_sweep import sweep_worker
from tests.helpers.dist import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # on demand: -m extended (docs/testing.md)

EXACT = (
    "deepseek_v3",
    "gpt_oss",
    "ernie4_5_moe",
    "phimoe",
    "glm4_moe",
    "llama4_text",
    "lfm2_moe",
    "kimi_linear",
    "dbrx",
    "longcat_flash",
)


class _InputWeightedExperts(nn.Module):
    """Experts that scale their INPUT by the routing weight: not linear in the weight, so sharding them with weight 1
    and weighting the outputs after would be wrong; the equality check must refuse the block."""

    def __init__(self, E: int = 4, H: int = 8, I: int = 6):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H, generator=g) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(E, H, I, generator=g) * 0.3)
        self.num_experts = E

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            x = hidden_states[tok] * top_k_weights[tok, pos, None]
            gate, up = (x @ self.gate_up_proj[e].T).chunk(2, dim=-1)
            out = out.index_add(0, tok, (nn.functional.silu(gate) * up) @ self.down_proj[e].T)
        return out


class _RowBlockGLU(nn.Module):
    """DBRX's layout (experts as (E * F, H) row blocks) plus a shared (H, H) mixing matrix whose dim 0 also divides by
    E: slicing it by expert would change the block, so the equality check must refuse it."""

    def __init__(self, E: int = 4, H: int = 8, F: int = 6):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(E * F, H, generator=g) * 0.3)
        self.w2 = nn.Parameter(torch.randn(E * F, H, generator=g) * 0.3)
        self.mix = nn.Parameter(torch.randn(H, H, generator=g) * 0.3)


class _RowBlockExperts(nn.Module):
    def __init__(self, E: int = 4, F: int = 6):
        super().__init__()
        self.mlp, self.num_experts, self.F = _RowBlockGLU(E, F=F), E, F

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        w1, w2 = (w.view(-1, self.F, w.shape[-1]) for w in (self.mlp.w1, self.mlp.w2))
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            y = (nn.functional.silu(hidden_states[tok] @ w1[e].T) @ w2[e]) @ self.mlp.mix
            out = out.index_add(0, tok, y * top_k_weights[tok, pos, None])
        return out


class _Block(nn.Module):
    def __init__(self, experts: type = _InputWeightedExperts):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = experts()

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        w, idx = torch.topk(self.gate(flat).softmax(-1), 2, dim=-1)
        return self.experts(flat, idx, w).view_as(x)


class _Model(nn.Module):
    def __init__(self, experts: type = _InputWeightedExperts):
        super().__init__()
        torch.manual_seed(0)
        self.mlp = _Block(experts)
        self.config = type("Cfg", (), {"hidden_size": 8, "model_type": "toy"})()


def _sensitivity(rank: int, world_size: int, experts: type = _InputWeightedExperts) -> str:
    from hfpar.parallel.expert_parallel import apply_expert_parallel

    model = _Model(experts)
    try:
        apply_expert_parallel(model, dist.group.WORLD)
    except ValueError as exc:  # nothing left sharded
        assert type(model.mlp.experts) is experts
        assert all(p.shape[0] in (4, 24, 8) for p in model.mlp.experts.parameters())
        return str(exc)
    return "accepted"


def _sensitivity_zero(rank: int, world_size: int) -> str:
    """LongCat-Flash with its experts without weights computed 1.5x where the token is: refused by the check."""
    from benchmarks.moe.ep_family_sweep import build
    from hfpar.parallel.expert_parallel import hf_experts

    model = build("longcat_flash")
    found, _ = hf_experts.find_hf_experts(model)
    assert [x.zero for x in found] == [2, 2], found
    own = hf_experts._own_forward

    def wrong(self, x, ids, dtype, *args, **kwargs):
        y = own(self, x, ids, dtype, *args, **kwargs)
        return y * 1.5 if ids.numel() and int(ids.min()) >= self._hfpar_ep.count else y

    hf_experts._own_forward = wrong
    try:
        hf_experts.shard_hf_experts(found, dist.group.WORLD, model.config.hidden_size)
        return "accepted"
    except ValueError as exc:
        return str(exc)
    finally:
        hf_experts._own_forward = own


def _worker(rank: int, world_size: int) -> dict:
    res = sweep_worker(rank, world_size, [*EXACT, "jetmoe"])
    res["sensitivity"] = _sensitivity(rank, world_size)
    res["sensitivity_rows"] = _sensitivity(rank, world_size, _RowBlockExperts)
    res["sensitivity_zero"] = _sensitivity_zero(rank, world_size)
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=600)[0]


@pytest.mark.parametrize("model_type", EXACT)
def test_exact(results, model_type):
    r = results[model_type]
    assert r["status"] == "exact" and r["how"] == "hf_block", r


def test_refused_in_one_line(results):
    r = results["jetmoe"]
    assert r["status"] == "refused" and "\n" not in r["why"], r
    assert "model.layers.0.mlp.input_linear (JetMoeParallelExperts) cannot be sharded by expert" in r["why"], r


def test_check_refuses_a_block_it_would_change(results):
    why = results["sensitivity"]
    assert "mlp.experts (_InputWeightedExperts): the expert-parallel block differs from the HF block" in why, why
    assert "\n" not in why
    why = results["sensitivity_rows"]  # a shared tensor among row-block experts: sliced, it fails the check
    assert "mlp.experts (_RowBlockExperts): the expert-parallel block" in why and "\n" not in why, why
    why = results["sensitivity_zero"]  # zero-computation experts wrong where the token is: the direct call sees it
    assert "(LongcatFlashExperts): the expert-parallel block differs" in why and "experts called directly" in why, why
