"""hfpar.integrations' model helpers on 2 gloo ranks against the unsharded model: gathered_grads (the debugging
helper) and the one global norm of clip_grad_norm_ (which finishes the grads), labels= inside full_vocab_logits, the
sharding record, FSDP1's and a DeepSpeed engine's refusals and the record's release (the entry points themselves:
tests/launch/test_integrations.py).

    python -m pytest -q tests/distributed/test_integrations.py
"""

from __future__ import annotations

import deepspeed
import torch
from torch.distributed.fsdp import FullyShardedDataParallel

from hfpar.integrations import clip_grad_norm_, gathered_grads, parallelize
from hfpar.parallel.guard import parallel_record, release
from hfpar.parallel.tensor_parallel import full_vocab_logits
from tests.helpers.dist import run_distributed
from tests.helpers.tp_models import batch, build, rel

DEEPSPEED = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
}


def _check(rank, world):
    ids, mask, labels = batch()
    for model_type, tp, ep in (("qwen3", 2, 1), ("qwen2_moe", 1, 2)):
        ref, model = build(model_type), build(model_type)
        parallelize(model, tp_size=tp, ep_size=ep)
        assert parallel_record(model) == [f"{'tensor' if tp > 1 else 'expert'}-parallel over 2 ranks"]
        ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        norm = clip_grad_norm_(model.parameters(), 1e9)  # finishes the grads (once), then the one global norm
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
        assert rel(norm, ref_norm) < 1e-5, (model_type, float(norm), float(ref_norm))
        got, want = gathered_grads(model), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert got.keys() == want.keys(), (model_type, got.keys() ^ want.keys())
        worst = max(rel(got[n], want[n]) for n in want)
        assert worst < 1e-5, (model_type, worst)
        if tp > 1:  # labels= on the gathered logits
            with torch.no_grad(), full_vocab_logits(model):
                out = model(input_ids=ids, attention_mask=mask, labels=labels)
            assert out.logits.shape[-1] == ref.config.vocab_size
            assert rel(out.loss, ref(input_ids=ids, attention_mask=mask, labels=labels).loss) < 1e-5
        try:  # FSDP1 refused before any broadcast
            FullyShardedDataParallel(model)
            raise AssertionError("FSDP1 accepted a sharded model")
        except RuntimeError as e:
            assert "FullyShardedDataParallel of a model that is" in str(e) and "\n" not in str(e), str(e)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=DEEPSPEED
        )  # nothing of the model to refuse on: its first forward
        try:
            engine(input_ids=ids, attention_mask=mask, labels=labels)
            raise AssertionError("a DeepSpeed engine ran a sharded model")
        except RuntimeError as e:
            assert "hfpar: deepspeed.initialize" in str(e) and "\n" not in str(e), str(e)
        release(model)  # stock DDP accepts it again
        assert isinstance(model.__dict__.get("_ddp_params_and_buffers_to_ignore", []), list)


def test_model_helpers_match_the_unsharded_model():
    run_distributed(_check, 2)
