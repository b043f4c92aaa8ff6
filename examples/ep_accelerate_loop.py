"""Expert parallelism in your own training loop: a tiny Mixtral built from a config (no download), its experts
split over every process by apply_expert_parallel, trained with model(**batch).loss.

    torchrun --nproc_per_node 2 examples/ep_accelerate_loop.py     # CPU + gloo here; CUDA + NCCL unchanged
    python examples/ep_accelerate_loop.py                           # one process, the same global batch

Prints `step <n> loss <global-batch mean>` per step; both commands print the same losses (fp32, within 1e-5).
Each process takes rows rank::world of a global batch of 8. The aux loss is hfpar's global one
(aux_loss_coef=...: statistics over every process's tokens, as in one process, injected in backward);
without aux_loss_coef the model keeps HF's objective (aux loss only with output_router_logits, each process
on its own tokens, as under DDP).
"""

import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import MixtralConfig, MixtralForCausalLM

from hfpar import apply_expert_parallel
from hfpar.parallel.expert_parallel import expert_parameters, non_expert_parameters, set_aux_loss_grad_scale
from hfpar.parallel.sharding import reduce_dp_grads


def sync_grads(model, world: int) -> None:
    """The data-parallel mean of every grad. Experts differ across processes, so the model is not wrapped in DDP
    (which would broadcast rank 0's experts and average all grads): an expert's grad already holds the tokens of
    every process that routed to it, reduce_dp_grads divides it by the dp size; replicated grads are averaged."""
    reduce_dp_grads(expert_parameters(model))
    grads = [p.grad for p in non_expert_parameters(model) if p.grad is not None]
    if world > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        for g, f in zip(grads, flat.div_(world).split([g.numel() for g in grads])):
            g.copy_(f.view_as(g))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global_batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=16)
    parser.add_argument("--aux_loss_coef", type=float, default=0.02)
    args = parser.parse_args()

    acc = Accelerator(cpu=not torch.cuda.is_available())  # process group: gloo on CPU, NCCL on GPUs
    world, rank = acc.num_processes, acc.process_index
    cfg = MixtralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)  # the same full weights on every process
    model = MixtralForCausalLM(cfg).to(acc.device).train()
    apply_expert_parallel(model, aux_loss_coef=args.aux_loss_coef)  # EP over all processes: E / world each
    set_aux_loss_grad_scale(world)  # injected aux grad: survives the dp mean below
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg.vocab_size, (2, args.global_batch, args.seq_len), generator=gen)  # 2 global batches
    for step in range(1, args.steps + 1):
        ids = data[step % 2]  # (B, T), the global batch of this step
        batch = {"input_ids": ids[rank::world].to(acc.device), "labels": ids[rank::world].to(acc.device)}
        loss = model(**batch).loss  # mean over this process's rows (equal lengths)
        acc.backward(loss)
        sync_grads(model, world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = acc.reduce(loss.detach(), reduction="mean")  # the global-batch mean
        acc.print(f"step {step} loss {mean.item():.8f}")
    acc.end_training()


if __name__ == "__main__":
    main()
