"""Dropout under tensor parallelism (hfpar/parallel/tensor_parallel/rng.py), 2 gloo ranks, a tiny BERT classifier with
attention-probability dropout 0.5 (inside the attention region) and hidden dropout 0.3 (after the row-parallel
layers, on replicated activations), built so that rank 1's heads hold the very weights of rank 0's:

- in training, the two ranks' attention regions give different outputs: their heads drew masks of their own (without
  the fork both ranks draw the same numbers, and identical heads give identical outputs; in eval they do);
- everything replicated stays replicated: the logits are the same on both ranks, and so is the generator's next draw;
- activation checkpointing recomputes the same masks: the gradients of a checkpointed forward equal those of the
  plain forward under the same seed;
- under sequence parallelism a dropout of the decoder layer outside the regions (Falcon's, after the MLP's
  row-parallel projection) acts on the rank's T/2 tokens: its masks differ over the ranks, the loss and the next draw
  do not.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint
from transformers import BertConfig, BertForSequenceClassification, FalconForCausalLM

from benchmarks.tensor_parallel.family_sweep import tiny_config
from hfpar.parallel.tensor_parallel import apply_tensor_parallel
from tests.helpers.dist import run_distributed


def _model():
    cfg = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        attention_probs_dropout_prob=0.5,
        hidden_dropout_prob=0.3,
        num_labels=3,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    with torch.no_grad():  # heads 2, 3 (rank 1's) := heads 0, 1 (rank 0's)
        for layer in model.bert.encoder.layer:
            att = layer.attention.self
            for lin in (att.query, att.key, att.value):
                lin.weight[16:] = lin.weight[:16]
                lin.bias[16:] = lin.bias[:16]
    return model


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _worker(rank: int, world: int) -> dict:
    model = _model()
    apply_tensor_parallel(model, dist.group.WORLD)
    region = model.bert.encoder.layer[0].attention.self
    seen = []
    region.register_forward_hook(lambda m, a, out: seen.append(out[0].detach()))
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    res = {}
    for mode in ("eval", "train"):
        getattr(model, mode)()
        torch.manual_seed(5)
        logits = model(input_ids=ids).logits
        a, b = _gather(seen[-1])
        res[f"{mode}_region_equal"] = bool(torch.equal(a, b))
        la, lb = _gather(logits.detach())
        res[f"{mode}_logits_equal"] = bool(torch.equal(la, lb))
        na, nb = _gather(torch.rand(4))
        res[f"{mode}_next_draw_equal"] = bool(torch.equal(na, nb))
    grads = []
    for ckpt in (False, True):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        emb = model.bert.embeddings(input_ids=ids)
        h = emb
        for layer in model.bert.encoder.layer:
            h = checkpoint(layer, h, use_reentrant=False) if ckpt else layer(h)
            h = h[0] if isinstance(h, tuple) else h
        h.pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.bert.encoder.parameters() if p.grad is not None])
    res["checkpoint_same_grads"] = all(torch.equal(x, y) for x, y in zip(*grads))
    return res


def test_region_dropout_draws_per_rank_and_the_rest_stays_in_step():
    res = run_distributed(_worker, 2)[0]
    assert res["eval_region_equal"], "the construction: identical heads on both ranks give identical region outputs"
    assert not res["train_region_equal"], "the TP ranks' heads drew the same dropout masks"
    assert res["train_logits_equal"] and res["eval_logits_equal"], "replicated activations differ over the TP ranks"
    assert res["train_next_draw_equal"], "the TP ranks' generators fell out of step"
    assert res["checkpoint_same_grads"], "a recomputed region drew other masks"


def _sp_worker(rank: int, world: int) -> dict:
    """Falcon with hidden dropout 0.5 under TP=2 + sequence parallelism: the decoder layer's own dropout (outside the
    TP regions: after the MLP's row-parallel projection, added to the residual) acts on this rank's T/2 tokens; its
    masks must be this rank's own."""
    cfg = tiny_config("falcon")  # the TP sweep's (sequence parallelism exact on it), dropout off; then on:
    cfg.hidden_dropout = 0.5
    torch.manual_seed(0)
    model = FalconForCausalLM(cfg)
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=True)
    masks, dropout = [], torch.nn.functional.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        out = dropout(x, p, training, inplace)
        if p > 0 and training and x.shape[1] == 6:  # the block's T/2 tokens
            masks.append(((out == 0) & (x != 0)).float())
        return out

    model.train()
    torch.manual_seed(5)
    ids = torch.randint(3, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with mock.patch.object(torch.nn.functional, "dropout", recording):
        loss = model(input_ids=ids, labels=ids).loss  # replicated (the logits are this rank's vocabulary shard)
    a, b = _gather(torch.stack(masks))
    la, lb = _gather(loss.detach().reshape(1))
    na, nb = _gather(torch.rand(4))
    return {
        "masks": len(masks),
        "masks_equal": bool(torch.equal(a, b)),
        "loss_equal": bool(torch.equal(la, lb)),
        "next_draw_equal": bool(torch.equal(na, nb)),
    }


def test_sequence_parallel_chunks_draw_their_own_masks():
    res = run_distributed(_sp_worker, 2)[0]
    assert res["masks"] >= 2, res  # a dropout of the rank's tokens in each of the 2 layers
    assert not res["masks_equal"], "the TP ranks' token chunks drew the same dropout masks"
    assert res["loss_equal"] and res["next_draw_equal"], res
