"""Context parallelism in your own plain torch loop: every row's sequence split over the processes, attention exact over
the whole row (ring, then Ulysses), HF's `model(**batch).loss` with the label shift done once by hfpar.

    torchrun --standalone --nproc_per_node 2 examples/cp_loop.py     # cp 2: ring, ulysses, then both in Accelerate
    python examples/cp_loop.py                                        # 1 process: the reference (plain attention)

CPU + gloo or CUDA + NCCL, unchanged. A tiny Llama is built from a config (same seed = same weights everywhere). Each
step: the global batch (uneven lengths), cut for this cp rank by hfpar.integrations.cp_batch (labels shifted before
the cut and passed as shift_labels, so HF's loss cannot shift them again), forward and backward inside cp_rows, the
loss normalized by the real targets of the whole batch (num_items_in_batch), grads SUMMED over the cp ranks (each
holds its tokens' part). Prints `<mode> step N loss X`, equal to the 1-process run's (fp32, within 1e-5).

The Accelerate variant (`acc-ring`, `acc-ulysses`): accelerator.prepare(model, optimizer) wraps the (replicated) model
in DDP over the world, which here is the cp group; DDP AVERAGES grads, so the loss is scaled by cp to make it the sum;
accelerator.backward / clip_grad_norm_ as usual. The batch is NOT given to a prepared data loader: every cp rank
must read the same rows (each keeps its part of the sequence). With data parallelism next to cp, shard the rows by
dp rank yourself and scale by dp x cp.
"""

import argparse
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from hfpar.integrations import clip_grad_norm_
from hfpar.integrations.context_parallel import count_targets, cp_batch
from hfpar.parallel.context_parallel import cp_rows, register_cp_attention


def global_batch(step: int, rows: int = 2, seq: int = 16, vocab: int = 256) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)  # (B, T)
    lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return {
        "input_ids": ids.masked_fill(mask == 0, 0),
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, -100),
    }


def train(mode: str, steps: int, device, cp: int, rank: int) -> None:
    acc = None
    if mode.startswith("acc-"):
        from accelerate import Accelerator  # (the Accelerate variant only: it adopts the process group made here)

        acc, mode = Accelerator(cpu=device.type == "cpu"), mode[4:]
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    if cp > 1:
        model.set_attn_implementation(register_cp_attention())  # "hfpar_cp", from transformers' registry
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    if acc is not None:
        model, opt = acc.prepare(model, opt)  # DDP over the world (= the cp group)
    for step in range(1, steps + 1):
        batch = {k: v.to(device) for k, v in global_batch(step % 2).items()}  # two batches, in turn
        n_items = count_targets(batch)  # real targets of the whole batch
        if cp > 1 and acc is not None:
            local, rows = cp_batch(batch, rank, cp)
            with cp_rows(rows, dist.group.WORLD, mode):
                loss = model(**local, num_items_in_batch=n_items).loss
                acc.backward(loss * cp)  # DDP's mean over cp ranks -> their sum
            loss = acc.reduce(loss.detach(), reduction="sum")
        elif cp > 1:
            local, rows = cp_batch(batch, rank, cp)  # (B, T / cp): this rank's zigzag part
            with cp_rows(rows, dist.group.WORLD, mode):  # cp group: the whole world here
                loss = model(**local, num_items_in_batch=n_items).loss  # my targets' sum / global count
                loss.backward()
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)  # SUM: each cp rank holds part of the tokens
            for g, f in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(f.view_as(g))
            loss = loss.detach()
            dist.all_reduce(loss)  # the whole batch's loss
        else:
            loss = model(**batch, num_items_in_batch=n_items).loss
            (loss.backward() if acc is None else acc.backward(loss))
        norm = (
            clip_grad_norm_(model.parameters(), 1.0)
            if acc is None  # replicated params: the plain norm
            else acc.clip_grad_norm_(model.parameters(), 1.0)
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(
                f"{'acc-' if acc is not None else ''}{mode} step {step} loss {loss.item():.8f} grad_norm "
                f"{float(norm):.8f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--modes", default="ring,ulysses,acc-ring,acc-ulysses")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    cp, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    for mode in args.modes.split(","):
        train(mode, args.steps, device, cp, rank)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
