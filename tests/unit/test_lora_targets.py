"""Where LoRA adapters will sit, decided before they are built (hfpar/loading/lora_targets.py): what tensor
parallelism (adapters built after the split) and the preflight (before the model loads) rely on.

Under transformers 5 PEFT's "all-linear" on a MoE model also targets the experts' 3-D weights and the routers'
(target_parameters); resolving only the Linear names (hfpar before) gave a TP run no expert adapters where one process
has them. The planned paths must be exactly the modules PEFT then wraps, on MoE and dense families alike.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from benchmarks.tensor_parallel.family_sweep import build
from hfpar.config import parse_args
from hfpar.context import ParallelContext
from hfpar.loading.lora import apply_lora, lora_config, lora_targets
from hfpar.loading.lora_targets import adapter_paths, adapters_in_moe_blocks, ep_lora_problem
from hfpar.parallel.expert_parallel import apply_expert_parallel
from hfpar.parallel.tensor_parallel.lora import TPLoraRefusal, get_tp_peft_model
from hfpar.preflight import model_problems

peft = pytest.importorskip("peft")

LORA = SimpleNamespace(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear", seed=0)
ATTENTION = SimpleNamespace(**{**vars(LORA), "lora_target_modules": "o_proj"})  # every family here but GPT-2
FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "olmoe", "llama", "phi3", "gpt2"]


def _built(model) -> list[str]:
    """The modules PEFT wrapped (an adapter layer, its ParamWrapper included), as paths of the HF model."""
    base = model.get_base_model()
    return [p for p, m in base.named_modules() if hasattr(m, "lora_A") and not p.endswith(".base_layer")]


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("args", [LORA, ATTENTION], ids=["all-linear", "o_proj"])
def test_planned_adapters_are_the_ones_peft_builds(model_type, args):
    if args is ATTENTION and model_type == "gpt2":  # no o_proj
        args = SimpleNamespace(**{**vars(LORA), "lora_target_modules": "c_attn"})
    model = build(model_type, dtype=torch.float32)
    planned = adapter_paths(model, lora_targets(model, args, "lm"))
    assert planned and planned == _built(apply_lora(model, args, "lm")), model_type


def test_all_linear_on_a_moe_model_reaches_the_experts_weights():
    model = build("qwen3_moe", dtype=torch.float32)
    config = lora_targets(model, LORA, "lm")
    assert {"gate_up_proj", "down_proj"} <= set(config.target_parameters or ()), config.target_parameters
    at = adapters_in_moe_blocks(model, config)
    assert {"model.layers.0.mlp.experts", "model.layers.0.mlp.gate"} <= set(at), at  # the router's weight too
    assert adapters_in_moe_blocks(model, lora_targets(model, ATTENTION, "lm")) == []


@pytest.mark.parametrize(
    "model_type, targets, refused",
    [
        ("qwen3_moe", "all-linear", "model.layers.*.mlp.experts"),
        ("mixtral", "all-linear", "model.layers.*.mlp.gate"),
        ("qwen3_moe", "q_proj,v_proj", None),
        ("qwen2_moe", "all-linear", None),  # its shared expert and gate only: called as the HF modules they are
        ("llama", "all-linear", None),
    ],
)
def test_ep_refusal_is_decided_before_the_model_loads(model_type, targets, refused):
    """From the config alone (its tiny copy), before any weight is read: the same one line apply_moe gives after."""
    args = SimpleNamespace(**{**vars(LORA), "lora_target_modules": targets})
    why = ep_lora_problem(AutoConfig.for_model(model_type), lora_config(args, "lm"), 2)
    if refused is None:
        assert why is None, why
    else:
        assert why.startswith("--use_peft with --ep_size 2: LoRA adapters sit on what expert parallelism computes")
        assert f"({refused}: a router or the experts)" in why and "\n" not in why, why


def test_tp_lora_takes_a_resolved_config_only():
    """An unresolved all-linear after TP would find only the Linear layers TP left whole; a list of names misses the
    experts' weights: both refused in one line, naming resolve_lora_config."""
    model = build("llama", dtype=torch.float32)
    for call in (
        lambda: get_tp_peft_model(model, peft.LoraConfig(target_modules="all-linear")),
        lambda: get_tp_peft_model(model, peft.LoraConfig(target_modules="all-linear"), ["q_proj"]),
    ):
        with pytest.raises(TPLoraRefusal) as e:
            call()
        assert "resolve_lora_config" in str(e.value) and "\n" not in str(e.value)


def test_adapters_inside_hfpar_moe_layers_are_refused_but_shared_experts_train():
    """hfpar's MoE layer computes its router and experts from their weights (an adapter there gets no gradient:
    refused); its shared expert and that expert's gate are called as the HF modules they are (adapters allowed)."""
    torch.manual_seed(0)
    model = apply_expert_parallel(build("qwen2_moe", dtype=torch.float32), aux_loss_coef=0.0)
    shared = peft.LoraConfig(target_modules=["shared_expert.gate_proj", "shared_expert_gate"], r=2, lora_dropout=0.0)
    wrapped = get_tp_peft_model(model, shared)
    assert any("shared_expert_gate" in p for p in _built(wrapped))
    model = apply_expert_parallel(build("qwen2_moe", dtype=torch.float32), aux_loss_coef=0.0)
    inside = next(p for p, _ in model.named_modules() if p.endswith("mlp.gate"))  # hfpar's router, under HF's name
    with pytest.raises(TPLoraRefusal) as e:
        get_tp_peft_model(model, peft.LoraConfig(target_parameters=[f"{inside}.weight"], r=2, lora_dropout=0.0))
    assert "inside hfpar's MoE layer" in str(e.value) and "--lora_target_modules" in str(e.value)


def test_the_preflight_refuses_adapters_expert_parallelism_would_bypass():
    """hfpar.preflight.model_problems: before the model loads (was: after loading it, in apply_moe)."""
    config = AutoConfig.for_model("qwen3_moe")
    ctx = ParallelContext.from_degrees(2, ep=2)
    for targets, refused in (("all-linear", True), ("q_proj,v_proj", False)):
        args = parse_args(["--use_peft", "--lora_target_modules", targets, "--lora_dropout", "0", "--ep_size", "2"])
        lines = [p for p in model_problems(args, ctx, "lm", config) if "--use_peft with --ep_size 2" in p]
        assert len(lines) == refused, lines


def _distilbert_classifier():
    from transformers import AutoModelForSequenceClassification

    cfg = AutoConfig.for_model("distilbert", dim=32, hidden_dim=64, n_layers=2, n_heads=4, vocab_size=128, num_labels=3)
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(cfg)


def test_all_linear_leaves_the_head_peft_saves_whole():
    """DistilBERT's pre_classifier ends with "classifier" (PEFT's SEQ_CLS head name, matched as a plain suffix): PEFT
    put LoRA on it and then failed to save it whole (a TypeError traceback); now it is trained whole with the head."""
    model = _distilbert_classifier()
    config = lora_targets(model, LORA, "classify")
    assert not any(t.endswith("classifier") for t in config.target_modules), config.target_modules
    wrapped = apply_lora(model, LORA, "classify")
    adapters = _built(wrapped)
    assert len(adapters) == 12 and all(".transformer.layer." in p for p in adapters), adapters  # 6 Linear x 2 layers
    whole = {n for n, p in wrapped.named_parameters() if p.requires_grad and "lora_" not in n}
    assert any("pre_classifier" in n for n in whole) and any(".classifier." in n for n in whole), whole


def test_a_named_target_peft_saves_whole_is_refused_in_one_line():
    args = SimpleNamespace(**{**vars(LORA), "lora_target_modules": "q_lin,pre_classifier"})
    with pytest.raises(ValueError) as e:
        apply_lora(_distilbert_classifier(), args, "classify")
    msg = str(e.value)
    assert (
        msg.startswith("--lora_target_modules q_lin,pre_classifier: names a module PEFT trains whole")
        and "\n" not in msg
    )
