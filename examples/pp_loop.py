"""Pipeline parallelism in your own plain torch loop: a tiny Llama with tied embeddings cut into one stage per process,
trained with the 1F1B schedule, its tied grads synced, one grad norm over the stages, and saved as ONE HF checkpoint.

    torchrun --standalone --nproc_per_node 2 examples/pp_loop.py --output_dir /tmp/pp   # 2 stages
    python examples/pp_loop.py --output_dir /tmp/pp1                                     # 1 process: the reference

CPU + gloo or CUDA + NCCL, unchanged. Both print `step N loss X grad_norm Y` (equal within 1e-5, fp32) and write a
checkpoint that from_pretrained loads (equal weights). The loss_fn contract is hfpar.integrations.pipeline's.
"""

import argparse
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from hfpar.integrations.pipeline import causal_lm_loss_fn, pipeline_clip_grad_norm_, save_pipeline_pretrained
from hfpar.parallel.pipeline import PipelineRunner, PipelineStage, balanced_split
from hfpar.parallel.pipeline.stage import tied_embedding_group


def global_batch(step: int, rows: int = 4, seq: int = 16, vocab: int = 256) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)  # (B, T)
    lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return {
        "input_ids": ids.masked_fill(mask == 0, 0),
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, -100),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--output_dir", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")
    pp = int(os.environ.get("WORLD_SIZE", "1"))
    if pp > 1:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank = dist.get_rank() if pp > 1 else 0
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    peers = list(range(pp))
    if pp > 1:
        stage = PipelineStage(model, rank, balanced_split(model, pp))  # this rank's layers (trimmed in place)
        runner = PipelineRunner(stage, peers, schedule="1f1b", microbatches=2)
        tied = tied_embedding_group([peers])  # first + last stage: the tied weight
        params = stage.parameters()
    else:
        params = model.parameters()
    opt = torch.optim.SGD(params, lr=0.3, momentum=0.9)
    for step in range(1, args.steps + 1):
        batch = {k: v.to(device) for k, v in global_batch(step % 2).items()}
        n = (batch["labels"][:, 1:] != -100).sum()  # real targets of the global batch
        if pp > 1:
            loss_sum, _ = runner.train(batch, causal_lm_loss_fn, scale=1 / n.item())  # every stage's backward
            norm = pipeline_clip_grad_norm_(stage, 1.0, tied_group=tied)
        else:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss_sum, _ = causal_lm_loss_fn(logits, batch["labels"])
            (loss_sum / n).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} loss {(loss_sum / n).item():.8f} grad_norm {float(norm):.8f}", flush=True)
    if args.output_dir and pp > 1:
        save_pipeline_pretrained(stage, args.output_dir, peers)  # collective: the merged HF checkpoint
    elif args.output_dir:
        model.save_pretrained(args.output_dir)
    if pp > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
