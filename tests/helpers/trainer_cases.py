"""Stock transformers.Trainer, TRL SFTTrainer and DPOTrainer training hfpar TP / EP models through
hfpar.integrations (tests/launch/test_integrations.py compares them with the same trainer in one process).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/helpers/trainer_cases.py OUT --cases a,b
    python tests/helpers/trainer_cases.py OUT --cases a,b --reference_world 2  # one process, same global batch

Each case writes OUT/<case>/history.json ([[loss, grad_norm], ...] per optimizer step) and OUT/<case>/model/ (the
saved HF checkpoint). fp32, 8 steps, gradient accumulation 2, clipping active (max_grad_norm below the norms).
With --refusals (distributed only), the unsafe entry points are tried first and their one-line errors written to
OUT/refusals.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hfpar.integrations import parallelize, prepare_trainer
from tests.helpers.tp_models import TINY, _no_dropout

TOKENIZER = Path(__file__).resolve().parents[2] / "hfpar" / "assets" / "tiny"
MOE = {
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "router_aux_loss_coef": 0.0,
    },
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0},
}
# name: (trainer, model_type, tp, ep[, "bf16"]); the world is tp x dp, dp = world / tp; fp32 unless "bf16" (autocast,
# fp32 master weights: Trainer's bf16=True)
CASES = {
    "trainer_qwen2_tp2": ("trainer", "qwen2", 2, 1),
    "trainer_olmoe_ep2": ("trainer", "olmoe", 1, 2),
    "sft_gemma2_tp2": ("sft", "gemma2", 2, 1),
    "sft_qwen2_moe_ep2": ("sft", "qwen2_moe", 1, 2),
    "dpo_qwen3_tp2": ("dpo", "qwen3", 2, 1),
    "dpo_olmoe_ep2": ("dpo", "olmoe", 1, 2),
    "trainer_qwen2_moe_tp2_ep2": ("trainer", "qwen2_moe", 2, 2),
    "trainer_qwen2_tp2_bf16": ("trainer", "qwen2", 2, 1, "bf16"),
    "trainer_olmoe_ep2_bf16": ("trainer", "olmoe", 1, 2, "bf16"),
}
STEPS, ACCUM, ROWS, MAX_NORM = 8, 2, 32, 0.05


def tiny(model_type: str):
    cfg = _no_dropout(AutoConfig.for_model(model_type, **{**TINY, **MOE.get(model_type, {})}))
    torch.manual_seed(0)  # the same full weights on every rank
    kw = {"experts_implementation": "eager"} if model_type in MOE else {}
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", **kw).float()


def rows(seed: int = 1) -> list[dict]:
    """ROWS rows of uneven length (9..16 tokens) and masked prompts (0..4 tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(ROWS):
        n, prompt = int(torch.randint(9, 17, (1,), generator=g)), int(torch.randint(0, 5, (1,), generator=g))
        out.append({"ids": torch.randint(3, 128, (n,), generator=g).tolist(), "prompt": prompt})
    return out


def padded(r: dict, length: int = 16) -> dict:
    ids = r["ids"] + [0] * (length - len(r["ids"]))
    mask = [1] * len(r["ids"]) + [0] * (length - len(r["ids"]))
    labels = [-100 if (i < r["prompt"] or not m) else t for i, (t, m) in enumerate(zip(ids, mask))]
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": torch.tensor(labels)}


def config_kwargs(out: Path, per_device: int, bf16: bool = False) -> dict:
    return {
        "output_dir": str(out),
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": ACCUM,
        "max_steps": STEPS,
        "optim": "sgd",
        "learning_rate": 0.5,
        "lr_scheduler_type": "constant",
        "max_grad_norm": MAX_NORM,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        "bf16": bf16,
    }  # fp32 unless asked (TRL's configs default to bf16)


def build_trainer(kind: str, model, ref_model, out: Path, per_device: int, bf16: bool = False):
    if kind == "trainer":
        from transformers import default_data_collator  # (per kind: TRL imports are heavy)

        return Trainer(
            model=model,
            args=TrainingArguments(**config_kwargs(out, per_device, bf16)),
            train_dataset=[padded(r) for r in rows()],
            data_collator=default_data_collator,
        )
    from datasets import Dataset  # (TRL cases only)

    tok = PreTrainedTokenizerFast.from_pretrained(TOKENIZER)
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer  # (TRL cases only)

        data = Dataset.from_list([{"input_ids": r["ids"]} for r in rows()])
        return SFTTrainer(
            model=model,
            args=SFTConfig(**config_kwargs(out, per_device), max_length=None),
            train_dataset=data,
            processing_class=tok,
        )
    from trl import DPOConfig, DPOTrainer  # (TRL cases only)

    rs = rows()
    text = lambda ids: tok.decode([i for i in ids if i >= 10])  # (printable characters)
    data = Dataset.from_list(
        [
            {"prompt": text(a["ids"][:4]), "chosen": text(a["ids"][4:]), "rejected": text(b["ids"][5:])}
            for a, b in zip(rs, rs[1:] + rs[:1])
        ]
    )
    return DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=DPOConfig(**config_kwargs(out, per_device), beta=0.5, max_length=None),
        train_dataset=data,
        processing_class=tok,
    )


def run_case(name: str, out: Path, reference_world: int) -> None:
    kind, model_type, tp, ep, *precision = CASES[name]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = 2 * (reference_world // tp if world == 1 else 1)  # one process: the global batch (x dp rows)
    model = tiny(model_type)
    ref = tiny(model_type) if kind == "dpo" else None
    if world > 1:
        parallelize(model, tp_size=tp, ep_size=ep)
        if ref is not None:
            parallelize(ref, tp_size=tp, ep_size=ep)
    trainer = build_trainer(kind, model, ref, out / name, per_device, bf16=precision == ["bf16"])
    if world > 1:
        prepare_trainer(trainer)
    trainer.train()
    trainer.save_model(str(out / name / "model"))
    hist = [[h["loss"], h["grad_norm"]] for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    if not dist.is_initialized() or dist.get_rank() == 0:
        (out / name / "history.json").write_text(json.dumps(hist))


def refusals(out: Path) -> None:
    """Every unsafe entry point refused in one line (rank 0 writes them)."""
    from accelerate import Accelerator  # (refusal checks only)
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from hfpar import apply_tensor_parallel

    errors = {}

    def attempt(what: str, fn) -> None:
        try:
            fn()
            errors[what] = None
        except Exception as e:  # noqa: BLE001 (the message is the result)
            errors[what] = f"{type(e).__name__}: {e}"

    attempt("unlaunched", lambda: apply_tensor_parallel(tiny("qwen2")))  # before any process group exists
    args = TrainingArguments(**config_kwargs(out / "refused", 2))  # creates the process group
    for kind, (tp, ep, model_type) in {"tp": (2, 1, "qwen2"), "ep": (1, 2, "olmoe")}.items():
        model = tiny(model_type)
        parallelize(model, tp_size=tp, ep_size=ep)
        attempt(f"{kind}_ddp", lambda m=model: DistributedDataParallel(m))
        attempt(f"{kind}_accelerate", lambda m=model: Accelerator(cpu=True).prepare(m))
        attempt(
            f"{kind}_trainer",
            lambda m=model: Trainer(model=m, args=args, train_dataset=[padded(r) for r in rows()]).train(),
        )
        attempt(f"{kind}_fully_shard", lambda m=model: fully_shard(m.model.layers[0]))
        attempt(f"{kind}_fsdp1", lambda m=model: FullyShardedDataParallel(m))
    if dist.get_rank() == 0:
        (out / "refusals.json").write_text(json.dumps(errors, indent=1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--reference_world", type=int, default=2, help="one process: the world it stands for")
    p.add_argument("--refusals", action="store_true")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.refusals:
        refusals(a.out)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        PartialState(cpu=True)  # the process group (TrainingArguments' own)
    for name in a.cases.split(","):
        run_case(name, a.out, a.reference_world)


if __name__ == "__main__":
    main()
