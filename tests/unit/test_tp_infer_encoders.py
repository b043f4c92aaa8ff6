"""The plans inferred for encoder classifiers whose projections out of a region live in a sibling module (BERT's
copies: infer.py _split_regions), read from the module structure alone (no process group). Whether they train the
unsharded model's math is tests/distributed/test_tp_classify_sweep.py's job."""

from __future__ import annotations

import torch

from benchmarks.tensor_parallel.classify_sweep import build
from hfpar.parallel.tensor_parallel.infer import infer_plans

_L = "roberta.encoder.layer.*"


def test_roberta_regions_hold_the_in_projections_and_the_siblings_project_out():
    plans = infer_plans(build("roberta", 2, torch.float32))
    assert {k: v for k, v in plans[0].items() if k.startswith(_L)} == {
        f"{_L}.attention.self": "attention",  # not `attention`: its input also feeds the residual in `output`
        f"{_L}.attention.self.query": "colwise",
        f"{_L}.attention.self.key": "colwise",
        f"{_L}.attention.self.value": "colwise",
        f"{_L}.attention.output.dense": "rowwise",
        f"{_L}.intermediate": "mlp",
        f"{_L}.intermediate.dense": "colwise",
        f"{_L}.output.dense": "rowwise",
    }
    assert plans[0]["roberta.embeddings.word_embeddings"] == "vocab_embedding"
    assert "classifier.dense" not in plans[0] and "classifier.out_proj" not in plans[0]  # the head stays whole


def test_the_attention_left_whole_takes_its_out_projection_with_it():
    """The last candidate keeps the attention replicated and shards the MLPs: the out-projection outside the region
    (attention.output.dense) must stay whole too, else it would take a whole input as a shard."""
    last = infer_plans(build("roberta", 2, torch.float32))[-1]
    assert not any(k.startswith(f"{_L}.attention") for k in last)
    assert last[f"{_L}.intermediate"] == "mlp" and last[f"{_L}.output.dense"] == "rowwise"


def test_distilbert_names_and_an_mlp_with_a_norm_inside_is_not_a_region():
    plan = infer_plans(build("distilbert", 2, torch.float32))[0]
    lay = "distilbert.transformer.layer.*"
    assert plan[f"{lay}.attention"] == "attention" and plan[f"{lay}.attention.out_lin"] == "rowwise"
    assert plan[f"{lay}.ffn"] == "mlp" and plan[f"{lay}.ffn.lin2"] == "rowwise"
    mobile = infer_plans(build("mobilebert", 2, torch.float32))[0]
    assert not any(k.endswith("bottleneck.input") for k in mobile)  # dense + LayerNorm: not an MLP's up-projection


def test_xlm_attention_and_mlp_lists_are_both_planned():
    plan = infer_plans(build("xlm", 2, torch.float32))[0]
    assert plan["transformer.attentions.*"] == "attention"  # the list element is the attention
    assert plan["transformer.attentions.*.out_lin"] == "rowwise"
    assert plan["transformer.ffns.*.lin1"] == "colwise" and plan["transformer.ffns.*.lin2"] == "rowwise"
