"""Checkpoints (resumable training state) and the final export in Hugging Face format.

Layout under --output_dir (this module is its one definition: save, resume and `hfpar export` use it):
    checkpoint-<step>/      a resumable training state:
        trainer_state.json              step, world size, dp/tp/ep/cp/pp, strategy, global batch (read before loading)
        config.json (+ tokenizer)       so that `hfpar export` needs the checkpoint only
        model.safetensors | pytorch_model_fsdp_0/ | DeepSpeed folder + `latest`    Accelerate's save_state
        rank<r>_of<world>.pt            per-rank shards hfpar owns (FSDP2 x TP/EP, experts)
        tp_rank<t>_of<tp>.pt            one file per TP rank (TP x DDP: dp replicas are identical)
        COMPLETE                        marker, written last
    config.json, model*.safetensors, tokenizer files   (final export, from_pretrained-loadable)

Crash safety: a checkpoint is written to `.checkpoint-<step>.tmp/`, its files fsynced, then renamed
to `checkpoint-<step>/` and marked COMPLETE. `latest` only ever picks a COMPLETE checkpoint, so a
kill during a save leaves the previous one usable. Retention (--save_total_limit) only deletes
older COMPLETE checkpoints written by hfpar and never the newest.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor

from hfpar.config import ConfigError
from hfpar.distributed import gathered_state_dict, unwrap
from hfpar.loading.lora import export_lora
from hfpar.parallel.expert_parallel.upcycle import is_upcycled, save_upcycled_pretrained

MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _CKPT_RE.match(child.name)
        if m and (child / MARKER).is_file():
            found.append((int(m.group(1)), child))
    return [p for _, p in sorted(found)]


def has_any_checkpoint(output_dir: str | os.PathLike) -> bool:
    root = Path(output_dir)
    return root.is_dir() and any(_CKPT_RE.match(c.name) for c in root.iterdir())


def resolve_resume(resume: str | None, output_dir: str) -> Path | None:
    """`latest` -> newest complete checkpoint or None (fresh run); a path must be a complete checkpoint."""
    if not resume:
        return None
    if resume == "latest":
        ckpts = list_checkpoints(output_dir)
        return ckpts[-1] if ckpts else None
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(f"--resume_from_checkpoint {resume}: no such directory (use 'latest' or a checkpoint-<step> dir)")
    if not (path / MARKER).is_file():
        raise ConfigError(f"--resume_from_checkpoint {resume}: checkpoint is incomplete (no {MARKER} marker); pick an earlier one")
    return path


def rank_state_file(ckpt_dir: str | os.PathLike, ctx) -> Path:
    return Path(ckpt_dir) / f"rank{ctx.rank:03d}_of{ctx.world:03d}.pt"


def tp_state_file(ckpt_dir: str | os.PathLike, ctx) -> Path:
    return Path(ckpt_dir) / f"tp_rank{ctx.tp_rank:02d}_of{ctx.tp:02d}.pt"


def has_rank_shards(ckpt_dir: str | os.PathLike) -> bool:
    """Per-rank model-parallel shards (TP / EP), which only a run with the same sizes can read back."""
    ckpt_dir = Path(ckpt_dir)
    return any(ckpt_dir.glob("tp_rank*_of*.pt")) or any(ckpt_dir.glob("rank*_of*.pt"))


def model_state_kind(ckpt_dir: str | os.PathLike) -> str | None:
    """Which writer holds the model weights of a checkpoint: safetensors | bin | dcp | deepspeed | None."""
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / "model.safetensors").is_file():
        return "safetensors"
    if (ckpt_dir / "pytorch_model.bin").is_file():
        return "bin"
    if (ckpt_dir / "pytorch_model_fsdp_0" / ".metadata").is_file():
        return "dcp"
    if (ckpt_dir / "latest").is_file():
        return "deepspeed"
    return None


def local_state(obj) -> object:
    """A (nested) state dict with every DTensor replaced by its local shard (torch.save-able per rank)."""
    if isinstance(obj, DTensor):
        return obj.to_local().clone()
    if isinstance(obj, dict):
        return {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_state(v) for v in obj]
    return obj


def load_local_state(live, saved):
    """Copy saved local shards into the live (possibly DTensor) tensors of a state dict, in place."""
    if isinstance(live, torch.Tensor):
        (live.to_local() if isinstance(live, DTensor) else live).copy_(saved)
        return live
    if isinstance(live, dict):
        return {k: load_local_state(live[k], saved[k]) if k in live else saved[k] for k in saved}
    if isinstance(live, list):
        return [load_local_state(a, b) for a, b in zip(live, saved)]
    return saved


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load per-rank local optimizer state: param-shaped tensors become DTensors like their params (FSDP2)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for idx, st in saved["state"].items():
        p = params[int(idx)]
        new = {}
        for k, v in st.items():
            if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() > 0 and v.shape == p.to_local().shape:
                v = DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements, run_check=False)
            new[k] = v
        state[idx] = new
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_model_config(accelerator: Accelerator, tmp: Path, tokenizer) -> None:
    """config.json (and the tokenizer, when given) next to the state, so `hfpar export` needs the checkpoint only."""
    for model in accelerator._models[:1]:  # empty for TP / EP runs, which hfpar wraps itself
        unwrapped = unwrap(model)
        if hasattr(unwrapped, "get_base_model"):  # PEFT: record the base model's class, not PEFT's wrapper
            unwrapped = unwrapped.get_base_model()
        if hasattr(unwrapped, "config"):
            config = copy.deepcopy(unwrapped.config)
            # what save_pretrained records; FSDP2 makes a subclass (FSDPLlamaForCausalLM): name the HF class
            cls = next(c for c in type(unwrapped).__mro__ if c.__module__.startswith("transformers") or c is object)
            config.architectures = [(cls if cls is not object else type(unwrapped)).__name__]
            config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)


def save_checkpoint(accelerator: Accelerator, output_dir: str, step: int, trainer_state: dict, save_total_limit: int | None,
                    extra=None, tokenizer=None) -> Path:
    """Collective: every rank must call it. `extra(tmp_dir)` writes state Accelerate does not know
    (per-TP-rank shards). Returns the final checkpoint path."""
    final = Path(output_dir) / f"checkpoint-{step}"
    tmp = Path(output_dir) / f".checkpoint-{step}.tmp"
    if accelerator.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)  # our own leftover from a killed save, never user data
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if extra is not None:
        extra(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2))
        _save_model_config(accelerator, tmp, tokenizer)
        _fsync_tree(tmp)
        if final.exists():  # same step saved again (e.g. resumed run re-saving): replace our own old copy
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(final / MARKER, "w") as fh:
            fh.write(str(step))
            fh.flush()
            os.fsync(fh.fileno())
        _apply_retention(output_dir, save_total_limit)
    accelerator.wait_for_everyone()
    return final


def _apply_retention(output_dir: str, limit: int | None) -> None:
    if not limit:
        return
    ckpts = list_checkpoints(output_dir)
    for old in ckpts[: max(0, len(ckpts) - limit)]:  # newest is always kept since limit >= 1
        shutil.rmtree(old, ignore_errors=True)


def read_trainer_state(path: Path) -> dict:
    """trainer_state.json of a checkpoint (step, world size, dp/tp/ep, global batch): cheap, loads no tensors."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def load_checkpoint(accelerator: Accelerator, path: Path) -> dict:
    accelerator.load_state(str(path))
    return read_trainer_state(path)


def export_model(accelerator: Accelerator, model, tokenizer, output_dir: str, state_dict=None) -> None:
    """Gather FSDP2 / ZeRO-3 shards and write a standard HF checkpoint at the root of output_dir.
    `state_dict`: already-gathered full tensors (tensor-parallel models gather their own shards)."""
    if state_dict is None:
        state_dict = gathered_state_dict(accelerator, model)  # collective: full tensors on the main process
    if accelerator.is_main_process:
        unwrapped = unwrap(model)
        state_dict = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
    accelerator.wait_for_everyone()


def export_final(accelerator: Accelerator, backend, tokenizer, args) -> None:
    """Collective. The final model in HF format at output_dir's root, whatever the composition: the backend
    gathers its shards (TP, EP, FSDP2 x TP) or leaves it to Accelerate (FSDP2 / ZeRO-3 gathered there);
    LoRA writes the adapter (or the merged model); an upcycled model is written as its HF MoE architecture."""
    if args.use_peft:
        export_lora(accelerator, backend.model, tokenizer, args.output_dir, merge=args.merge_adapter,
                    state_dict=backend.full_state_dict(), peft_model=backend.hf_model())
        return
    full = backend.full_state_dict()
    model = backend.unwrapped()
    if not is_upcycled(model):
        export_model(accelerator, backend.model, tokenizer, args.output_dir, state_dict=full)
        return
    full = gathered_state_dict(accelerator, backend.model) if full is None else full
    save_upcycled_pretrained(model, args.output_dir, state_dict=full, is_main_process=accelerator.is_main_process)
    if accelerator.is_main_process and tokenizer is not None:
        tokenizer.save_pretrained(args.output_dir)
    accelerator.wait_for_everyone()
