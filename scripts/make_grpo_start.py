"""Build the GRPO warm start in hfpar/assets/grpo_start/: the embedded tiny model after a short SFT on the embedded
GRPO task (offline, deterministic: fixed seed, one thread), then measure it on the task's eval prompts.

    python scripts/make_grpo_start.py                  # trains (~30 s of CPU, one thread), rewrites assets/grpo_start/
    python scripts/make_grpo_start.py --measure_only   # only measures the shipped warm start

Training: a plain torch loop (no launcher, no output folder of a run): the embedded tiny Llama, random init from
--seed, AdamW at a constant --learning_rate, batches of --batch_size examples drawn with replacement from the task's
train prompts (hfpar.data.grpo_task: prompt / completion, tokenized by hfpar.data.tokenize_sft, loss on the
completion and its eos). Stopped early on purpose (--max_steps): greedy decoding is mostly right while samples at
temperature 1.0 are right about 30 % of the time, which is the room GRPO's reward rises in.

Measured (written to grpo_start/warm_start.json): on the eval prompts (never trained on), the greedy accuracy; the
sampled accuracy with --num_generations samples per prompt at temperature 1.0 and up to --max_new_tokens tokens
(hfpar.rollout.sampling.sample, one row key per sample); and the signal fraction, the share of prompts whose samples
are neither all right nor all wrong (GRPO learns from those only). A completion is right when the builtin
`exact_match` reward says so.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hfpar import data
from hfpar.data.grpo_task import make_grpo_task, sft_examples
from hfpar.data.prompts import left_pad, tokenize_prompts
from hfpar.parallel.labels import IGNORE
from hfpar.rollout.rewards import exact_match
from hfpar.rollout.sampling import completion_mask, row_key, sample

OUT = Path(__file__).resolve().parents[1] / "hfpar" / "assets" / "grpo_start"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", default=str(OUT))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_steps", type=int, default=120)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--measure_only", action="store_true", help="measure the model in --output_dir, train nothing")
    return p.parse_args(argv)


def train(args, tok) -> torch.nn.Module:
    """The embedded tiny Llama, SFT for args.max_steps steps on the task's train prompts."""
    rows, _ = data.tokenize_sft(sft_examples(make_grpo_task(args.seed)["train"]), tok, 64)
    ids, labels = rows["input_ids"], rows["labels"]
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(data.embedded_model_path()))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    for step in range(1, args.max_steps + 1):
        batch = torch.randint(len(ids), (args.batch_size,), generator=g).tolist()
        width = max(len(ids[i]) for i in batch)
        x = torch.tensor([ids[i] + [tok.pad_token_id] * (width - len(ids[i])) for i in batch])  # (B, T)
        y = torch.tensor([labels[i] + [IGNORE] * (width - len(labels[i])) for i in batch])  # (B, T)
        mask = torch.tensor([[1] * len(ids[i]) + [0] * (width - len(ids[i])) for i in batch])  # (B, T)
        loss = model(input_ids=x, attention_mask=mask, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 20 == 0 or step == args.max_steps:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    return model.eval()


def _right(tok, prompt_set, rows: torch.Tensor, index: list[int]) -> torch.Tensor:
    """(N,) 1.0 where a completion row (tokens after the prompt) is right by the builtin exact_match."""
    keep = completion_mask(rows, tok.eos_token_id)
    texts = [tok.decode(r[m.bool()], skip_special_tokens=True) for r, m in zip(rows, keep)]
    answers = prompt_set.column_values(index)["answer"]
    completions = [[{"role": "assistant", "content": t}] for t in texts]  # as TRL passes conversational ones
    return torch.tensor(exact_match([prompt_set.prompts[i] for i in index], completions, answers))


@torch.no_grad()
def measure(model, tok, prompt_set, num_generations: int = 8, max_new_tokens: int = 16, seed: int = 0) -> dict:
    """Greedy accuracy, sampled accuracy (temperature 1.0) and signal fraction on a PromptSet with an answer column."""
    n = len(prompt_set)
    ids, mask = left_pad(prompt_set.prompt_ids, tok.pad_token_id)  # (n, P)
    kw = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "max_new_tokens": max_new_tokens}
    greedy = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, use_cache=True, **kw)
    greedy_ok = _right(tok, prompt_set, greedy[:, ids.size(1) :], list(range(n)))
    index = [i for i in range(n) for _ in range(num_generations)]
    keys = [row_key(seed, 0, i, g) for i in range(n) for g in range(num_generations)]
    rows = sample(model, ids[index], mask[index], keys, temperature=1.0, **kw)[:, ids.size(1) :]
    ok = _right(tok, prompt_set, rows, index).view(n, num_generations)  # (n, G)
    right = ok.sum(1)
    return {
        "prompts": n,
        "num_generations": num_generations,
        "max_new_tokens": max_new_tokens,
        "greedy_accuracy": round(greedy_ok.mean().item(), 4),
        "sampled_accuracy": round(ok.mean().item(), 4),
        "signal_fraction": round(((right > 0) & (right < num_generations)).float().mean().item(), 4),
        "all_right_fraction": round((right == num_generations).float().mean().item(), 4),
        "all_wrong_fraction": round((right == 0).float().mean().item(), 4),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the same floating-point sums wherever it is rebuilt
    out = Path(args.output_dir)
    t0 = time.perf_counter()
    if args.measure_only:
        tok = data.load_tokenizer(str(out))
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        record = json.loads((out / "warm_start.json").read_text()) if (out / "warm_start.json").exists() else {}
    else:
        tok = data.load_tokenizer(None)
        model = train(args, tok)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tok.save_pretrained(out)
        record = {
            "built_by": "scripts/make_grpo_start.py",
            "seed": args.seed,
            "max_steps": args.max_steps,
            "learning_rate": args.learning_rate,
            "batch_size": args.batch_size,
            "train_seconds": round(time.perf_counter() - t0, 1),
        }
    evals = tokenize_prompts(make_grpo_task(args.seed)["eval"], tok)
    t1 = time.perf_counter()
    record["eval"] = measure(model, tok, evals, args.num_generations, args.max_new_tokens, args.seed)
    record["measure_seconds"] = round(time.perf_counter() - t1, 1)
    print(json.dumps(record, indent=1))
    if not args.measure_only:
        (out / "warm_start.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
