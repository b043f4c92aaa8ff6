"""Tensor parallelism in your own Accelerate loop: hfpar's layers, HF's `model(**batch).loss`, Accelerate's prepare /
backward / clip_grad_norm_ / save_model made right by one call (hfpar.integrations.prepare_accelerator).

    torchrun --standalone --nproc_per_node 2 examples/tp_accelerate_loop.py              # tp 2
    torchrun --standalone --nproc_per_node 4 examples/tp_accelerate_loop.py --tp_size 2  # tp 2 x dp 2
    torchrun --standalone --nproc_per_node 2 examples/tp_accelerate_loop.py --tp_size 1  # dp 2 (no TP)
    python examples/tp_accelerate_loop.py                                                # 1 process: the reference

CPU + gloo or CUDA + NCCL, unchanged. A tiny Llama is built from a config (same seed on every rank = same full
weights) and sharded over each tp group by hfpar.integrations.parallelize. After prepare_accelerator(accelerator,
ctx), accelerator.prepare wraps the model in DDP over the dp group only (the ranks holding the same shards), the
data loader gives each dp rank its batches (the tp ranks of a replica read the same rows), clip_grad_norm_ is the
one global norm (every shard counted once) and save_model writes the gathered HF checkpoint. The loss is normalized
by the real target tokens of the whole global batch, so the printed losses (`step N loss X`) match the 1-process run.
"""

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from hfpar.integrations import parallelize, prepare_accelerator

ROWS = 4  # the global batch (rows per optimizer step), whatever the dp size


def global_batch(step: int, seq: int = 16, vocab: int = 256) -> list[dict]:
    """ROWS rows of uneven length (right padding masked out of the loss)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, vocab, (ROWS, seq), generator=g)  # (B, T)
    lengths = torch.randint(seq // 2, seq + 1, (ROWS,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    ids = ids.masked_fill(mask == 0, 0)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(ROWS)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp_size", type=int, default=None, help="default: all processes")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--output_dir", default=None, help="save the trained model here (a normal HF checkpoint)")
    args = parser.parse_args()
    acc = Accelerator(cpu=not torch.cuda.is_available())  # the process group (gloo on CPU, NCCL on GPUs)

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)  # the same full weights on every rank
    model = LlamaForCausalLM(cfg)
    ctx = parallelize(model, tp_size=args.tp_size or acc.num_processes)  # in place; tp 1: unchanged
    prepare_accelerator(acc, ctx)  # BEFORE accelerator.prepare
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    rows = [r for step in range(1, args.steps + 1) for r in global_batch(step % 2)]  # two batches, in turn
    loader = DataLoader(rows, batch_size=ROWS // ctx.dp)  # per device: the dp ranks split each global batch
    model, opt, loader = acc.prepare(model, opt, loader)

    for step, batch in enumerate(loader, start=1):
        n_local = (batch["labels"][:, 1:] != -100).sum()
        n_items = acc.reduce(n_local, reduction="sum") / ctx.tp  # real targets of the GLOBAL batch (tp counted once)
        loss = model(**batch, num_items_in_batch=n_items).loss  # sum over my targets / global count
        acc.backward(loss * ctx.dp)  # DDP averages over dp: the sum over every target / count
        norm = acc.clip_grad_norm_(model.parameters(), 1.0)  # the one global norm: every shard counted once
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = acc.reduce(loss.detach(), reduction="sum") / ctx.tp  # the global-token mean
        acc.print(f"step {step} loss {total.item():.8f} grad_norm {float(norm):.8f}")
    if args.output_dir:
        acc.save_model(model, args.output_dir)  # collective: gathered, written by rank 0
    acc.end_training()


if __name__ == "__main__":
    main()
