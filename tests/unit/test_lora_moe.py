"""LoRA on a MoE model without expert parallelism (PEFT 0.21's "all-linear" puts adapters on the routers and, through
its ParamWrapper, on the experts' 3-D weights): the MoE blocks stay the HF model's own, so the adapters train; before,
hfpar's MoE conversion met PEFT's wrapper and the recipe died with an AttributeError traceback. The routers' aux loss
through hfpar's path is refused in one line; PEFT's own refusal of dropout on expert weights names the flag to pass;
with --ep_size, adapters on a router or the experts are refused in one line.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.moe import lora_moe_sweep
from benchmarks.tensor_parallel.family_sweep import batch, build, vocab
from hfpar.loading.lora import apply_lora
from hfpar.parallel.expert_parallel import moe_replaced_paths
from hfpar.parallelize import apply_moe, lora_in_moe_blocks

pytest.importorskip("peft")

LORA = SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear", seed=0)
MOE_ARGS = SimpleNamespace(upcycle_experts=0, gradient_accumulation_steps=1)
CTX = SimpleNamespace(ep=1, grad_replicas=1)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_lora_in_moe_blocks_keeps_the_hf_blocks_and_trains_them(model_type):
    hf = build(model_type, dtype=torch.float32)
    replaced = moe_replaced_paths(hf)
    assert replaced == [
        f"model.layers.{i}.mlp.{c}" for i in range(hf.config.num_hidden_layers) for c in ("experts", "gate")
    ]
    model = apply_lora(hf, LORA, "lm")
    at = lora_in_moe_blocks(model, replaced)
    assert any(p.endswith("mlp.experts") for p in at) and any(p.endswith("mlp.gate") for p in at), at
    note = apply_moe(model, MOE_ARGS, CTX, moe_replaced=replaced)
    assert note.startswith("MoE blocks train as the HF model's own (LoRA adapters in them"), note
    with torch.no_grad():  # B starts at 0: give it values, so every adapter's A gets a gradient
        for m in model.modules():
            if hasattr(m, "lora_B") and "default" in m.lora_B:
                m.lora_B["default"].weight.normal_()
    ids, labels = batch(vocab(model))
    model(input_ids=ids, labels=labels).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_A" in n and ("experts" in n or "gate." in n)}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values()), grads.keys()


def test_aux_loss_with_lora_in_moe_blocks_is_refused_in_one_line():
    model = build("qwen3_moe", dtype=torch.float32)
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.01
    model = apply_lora(model, LORA, "lm")
    with pytest.raises(ValueError) as e:
        apply_moe(model, MOE_ARGS, CTX)
    assert "\n" not in str(e.value) and "output_router_logits" in str(e.value) and "lora_target_modules" in str(e.value)


def test_adapters_on_what_expert_parallelism_computes_are_refused_in_one_line():
    """--ep_size needs hfpar's MoE layers, which would bypass adapters on a router or the experts: refused, naming
    the module and the flag (targets outside them train under EP: tests/launch/test_lora.py)."""
    hf = build("qwen3_moe", dtype=torch.float32)
    replaced = moe_replaced_paths(hf)
    model = apply_lora(hf, LORA, "lm")
    with pytest.raises(ValueError) as e:
        apply_moe(model, MOE_ARGS, SimpleNamespace(ep=2, grad_replicas=1), moe_replaced=replaced)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--use_peft with --ep_size 2: LoRA adapters sit on what"), msg
    assert "model.layers.0.mlp." in msg and "--lora_target_modules" in msg, msg


def test_dropout_on_expert_weights_names_the_flag():
    with pytest.raises(ValueError) as e:
        apply_lora(
            build("qwen3_moe", dtype=torch.float32), SimpleNamespace(**{**vars(LORA), "lora_dropout": 0.05}), "lm"
        )
    msg = str(e.value)
    assert "\n" not in msg and "--lora_dropout 0 (not 0.05)" in msg, msg


def test_targets_outside_the_moe_blocks_keep_hfpar_moe_layers():
    model = apply_lora(
        build("qwen3_moe", dtype=torch.float32),
        SimpleNamespace(**{**vars(LORA), "lora_target_modules": "q_proj,v_proj"}),
        "lm",
    )
    assert lora_in_moe_blocks(model, moe_replaced_paths(model.get_base_model())) == []
    assert apply_moe(model, MOE_ARGS, CTX) is None  # converted: hfpar's MoE layers, as without LoRA


# Qwen2-MoE: "all-linear" puts adapters on the shared expert and its gate only (its router holds a bare weight, its
# experts 3-D tensors), which hfpar's MoE layer calls as the HF modules they are: the blocks are converted (before, the
# shared_expert_gate's "experts" sibling kept them the HF model's own) and the adapters train. Qwen3-MoE: on the router
# too, the blocks stay the HF model's own. Routers of other shapes (GPT-OSS, DeepSeek-V3), GraniteMoE-shared, and
# Llama 4 / PhiMoE whose routers are nn.Linear subclasses returning (scores, logits): PEFT's own LoRA layer fails
# there (refused in one line)
@pytest.mark.slow  # ~40 s: out of the fast tier (pytest -m "not slow", under 5 minutes)
@pytest.mark.parametrize(
    "model_type, status, hf_blocks",
    [
        ("qwen2_moe", "exact", False),
        ("qwen3_moe", "exact", True),
        ("gpt_oss", "exact", False),
        ("deepseek_v3", "exact", True),
        ("granitemoeshared", "exact", False),
        ("llama4_text", "refused", None),
        ("phimoe", "refused", None),
    ],
)
def test_lora_moe_sweep_subset(model_type, status, hf_blocks):
    """benchmarks/moe/lora_moe_sweep.py's check: apply_moe on the PEFT model against PEFT on the HF model, loss and
    every adapter gradient within 1e-4 (the whole sweep: every MoE type, benchmarks/results/moe/lora_moe_sweep.json)."""
    r = lora_moe_sweep.check(model_type)
    assert r["status"] == status and r.get("hf_blocks") == hf_blocks, r
    if status == "refused":
        assert "whose forward returns something other than its product" in r["why"] and "\n" not in r["why"], r


def test_a_linear_computing_its_product_its_own_way_stays_a_target():
    """Falcon's FalconLinear (an nn.Linear subclass, x @ W.T + b in its own forward) passes the probe: its adapters
    are built and train, as before the refusal of Linear subclasses that return something else."""
    model = apply_lora(build("falcon", dtype=torch.float32), LORA, "lm")
    assert any(type(m.base_layer).__name__ == "FalconLinear" for m in model.modules() if hasattr(m, "lora_A"))
    ids, labels = batch(vocab(model))
    model(input_ids=ids, labels=labels).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)
