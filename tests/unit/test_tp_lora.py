"""LoRA and tensor parallelism in one process (the 2-rank checks: tests/distributed/test_tp_lora_sweep.py and
tests/launch/test_lora.py): the order is refused the wrong way round, and what the split adapters cannot do is refused
in one line rather than trained wrongly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hfpar.parallel.errors import ParallelError
from hfpar.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, apply_tensor_parallel
from hfpar.parallel.tensor_parallel.lora import get_tp_peft_model

peft = pytest.importorskip("peft")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = ColumnParallelLinear.from_linear(nn.Linear(8, 16))
        self.down = RowParallelLinear.from_linear(nn.Linear(16, 8))

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_tp_on_a_peft_model_is_refused_naming_the_order():
    from benchmarks.tensor_parallel.family_sweep import build

    model = peft.get_peft_model(build("llama"), peft.LoraConfig(target_modules="all-linear"))
    with pytest.raises(ParallelError) as e:
        apply_tensor_parallel(model)
    assert "apply tensor parallelism first, then LoRA" in str(e.value) and "get_tp_peft_model" in str(e.value)


@pytest.mark.parametrize("kw", [{"use_dora": True}, {"lora_bias": True}])
def test_dora_and_lora_bias_are_refused_on_split_layers(kw):
    with pytest.raises(ValueError, match="is not supported on a tensor-parallel layer"):
        get_tp_peft_model(_Block(), peft.LoraConfig(target_modules=["up", "down"], **kw))


def test_split_layers_compute_lora_and_merging_them_in_place_is_refused():
    """At tp 1 the split is the whole: the output is PEFT's LoRA formula (W x + b + s B A x per layer)."""
    torch.manual_seed(0)
    model = get_tp_peft_model(_Block(), peft.LoraConfig(target_modules=["up", "down"], r=2, lora_dropout=0.0))
    up, down = model.base_model.model.up, model.base_model.model.down
    assert (type(up).__name__, type(down).__name__) == ("LoraColumnParallelLinear", "LoraRowParallelLinear")
    with torch.no_grad():
        for m in (up, down):
            m.lora_B["default"].weight.normal_()
    x, s = torch.randn(3, 8), up.scaling["default"]

    def lora(m, x):
        base = m.base_layer
        a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
        return x @ base.weight.T + base.bias + s * (x @ a.T @ b.T)

    torch.testing.assert_close(model(x), lora(down, torch.relu(lora(up, x))))
    with pytest.raises(NotImplementedError, match="merge the gathered export"):
        model.merge_and_unload()
