"""Tensor parallelism in your own training loop: hfpar's layers in a plain torch loop, HF's `model(**batch).loss`.

    torchrun --standalone --nproc_per_node 2 examples/tp_accelerate_loop.py              # tp 2
    torchrun --standalone --nproc_per_node 4 examples/tp_accelerate_loop.py --tp_size 2  # tp 2 x dp 2
    python examples/tp_accelerate_loop.py                                                # 1 process: the reference

CPU + gloo or CUDA + NCCL, unchanged. A tiny Llama is built from a config (same seed on every rank = same full
weights), sharded over each tp group; gradients are summed over the dp group (ranks holding the same shards).
Every run sees the same global batch (rows split by dp rank; the tp ranks of a replica share them) and the loss
is normalized by the real target tokens of the whole global batch (num_items_in_batch), so the printed losses
(`step N loss X`) match the 1-process run.
"""

import argparse
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from hfpar import apply_tensor_parallel, clip_tp_grad_norm_


def groups(tp: int):
    """(tp_group, dp_group): consecutive ranks share a model replica's shards; every rank creates every group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    tp_group = dp_group = None
    for i in range(world // tp):
        ranks = list(range(i * tp, (i + 1) * tp))
        g = dist.new_group(ranks)
        tp_group = g if rank in ranks else tp_group
    for j in range(tp):
        ranks = list(range(j, world, tp))
        g = dist.new_group(ranks)
        dp_group = g if rank in ranks else dp_group
    return tp_group, dp_group


def global_batch(step: int, rows: int = 4, seq: int = 16, vocab: int = 256):
    """The same rows on every rank (uneven lengths: right padding masked out of the loss)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)                            # (B, T)
    lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp_size", type=int, default=None, help="default: all processes")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=0.3)
    args = parser.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    tp = args.tp_size or world
    tp_group, dp_group = groups(tp) if distributed else (None, None)
    dp, dp_rank = world // tp, rank // tp

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)                                   # the same full weights on every rank
    model = LlamaForCausalLM(cfg).to(device)
    apply_tensor_parallel(model, tp_group)                 # in place; tp 1: unchanged
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for step in range(1, args.steps + 1):
        batch = global_batch(step % 2)                     # two batches, seen in turn: the loss falls
        n_items = (batch["labels"][:, 1:] != -100).sum()   # real targets of the GLOBAL batch (shifted labels)
        mine = {k: v[dp_rank::dp].to(device) for k, v in batch.items()}   # this replica's rows
        loss = model(**mine, num_items_in_batch=n_items.to(device)).loss   # sum over my targets / global count
        loss.backward()
        loss = loss.detach()
        if dp > 1:                                         # the replicas' grads (each already / global count)
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp_group)
            dist.all_reduce(loss, group=dp_group)          # global-token mean
        norm = clip_tp_grad_norm_(model.parameters(), 1.0)   # every shard counted once
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} loss {loss.item():.8f} grad_norm {norm.item():.8f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
