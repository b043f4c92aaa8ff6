"""The final model in Hugging Face format at --output_dir's root, whatever the composition, in three steps:

export_final(accelerator, backend, tokenizer, output_dir, peft=False, merge_adapter=False)   # collective
  1. gather      every rank: the full state dict (the backend gathers its TP / EP / pipeline shards, or
                 Accelerate gathers FSDP2 / ZeRO-3), full tensors on the main process
  2. write       the main process: the LoRA adapter (or the merged model), an upcycled model as its HF MoE
                 architecture, or the model itself; save_pretrained, safetensors
  3. tokenizer   the main process, next to the weights
Both written into a staging dir `.final-model.tmp/` first, then each file renamed into the output dir (publish): a
rename replaces a link of that name, never writes through it, and transformers' cleanup of "stale" shards runs in
the empty staging dir, never on a user's files at the root.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import torch
from transformers.integrations import deepspeed as hf_ds

from hfpar.checkpoint.ownership import STAGING_MARK, is_staging, owned_names, record_written
from hfpar.distributed import gathered_state_dict, swapped, unwrap, without_deepspeed_import
from hfpar.loading.lora import full_peft_model, merged_state_model
from hfpar.parallel.expert_parallel import is_upcycled, save_upcycled_pretrained
from hfpar.parallel.language_model import is_nested
from hfpar.parallel.sharding import tensor_names


def export_final(
    accelerator, backend, tokenizer, output_dir: str | Path, peft: bool = False, merge_adapter: bool = False
) -> None:
    """Collective: every rank calls it; the main process writes."""
    output_dir = str(output_dir)
    full = gather_full_state(accelerator, backend)
    if accelerator.is_main_process:
        stage = Path(output_dir) / ".final-model.tmp"
        if is_staging(stage):
            shutil.rmtree(stage)  # a killed export's leftover
        if stage.exists() or stage.is_symlink():  # the claim refused it; appeared since: left, said
            print(f"hfpar: warning: {stage} is not hfpar's: left as it is, the final model not saved", file=sys.stderr)
        else:
            stage.mkdir()
            (stage / STAGING_MARK).write_text("final")
            write_model(backend, full, str(stage), peft, merge_adapter)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(stage))
            publish(stage, Path(output_dir))
    accelerator.wait_for_everyone()


_WEIGHTS_RE = re.compile(r"^(model|adapter_model)(-\d+-of-\d+)?\.safetensors(\.index\.json)?$")


def publish(stage: Path, out: Path) -> None:
    """Main process: each file of the staged final model renamed into out (replacing hfpar's own file of that name,
    or a link itself: never its target), then an earlier export's weight files that the new one does not have (a
    different sharding) deleted where hfpar's ledger lists them; the staging dir removed."""
    (stage / STAGING_MARK).unlink()
    names = sorted(p.name for p in stage.iterdir())
    written = owned_names(out) or set()
    for name in names:
        dest = out / name
        if dest.is_dir() and not dest.is_symlink():  # a user's folder of that name (refused by the claim)
            print(f"hfpar: warning: {dest} is a folder hfpar did not write: {name} not saved", file=sys.stderr)
            continue
        os.replace(stage / name, dest)
    for old in out.iterdir():
        stale = _WEIGHTS_RE.match(old.name) and old.name not in names and old.name in written
        if stale and old.is_file() and not old.is_symlink():
            old.unlink()
    shutil.rmtree(stage, ignore_errors=True)
    record_written(out, add=tuple(names))


def gather_full_state(accelerator, backend) -> dict[str, torch.Tensor]:
    """Collective: full tensors under HF names on the main process (other ranks: whatever the gather leaves them)."""
    full = backend.full_state_dict()  # TP / EP / pipeline backends gather their own shards
    return gathered_state_dict(accelerator, backend.model) if full is None else full


def write_model(backend, full: dict[str, torch.Tensor], output_dir: str, peft: bool, merge_adapter: bool) -> None:
    """Main process: save_pretrained of the module that describes the trained model, with `full` as its weights.
    Outside transformers' ZeRO-3 hook: a model built here (an upcycled model's HF MoE architecture) must not be
    built under DeepSpeed's zero.Init, whose broadcasts would wait for the other ranks."""
    with without_deepspeed_import(), swapped(hf_ds, "_hf_deepspeed_config_weak_ref", None):
        _write_model(backend, full, output_dir, peft, merge_adapter)


def _write_model(backend, full: dict[str, torch.Tensor], output_dir: str, peft: bool, merge_adapter: bool) -> None:
    if peft:
        write_lora(backend, on_cpu(full), output_dir, merge_adapter)
    elif is_upcycled(backend.unwrapped()):  # written as the HF MoE architecture it became
        save_upcycled_pretrained(backend.unwrapped(), output_dir, state_dict=full, is_main_process=True)
    else:
        model = unwrap(backend.model)
        saving_model(model).save_pretrained(
            output_dir, state_dict=on_cpu(without_tied_copies(model, full)), safe_serialization=True
        )


def without_tied_copies(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`full` less the second name of each tensor the model holds under two (a LM head tied to the embedding).
    save_pretrained drops a tied weight's second name only where the two share storage; gathered from FSDP2 shards
    they are two tensors, and the export held the head twice where one process writes the embedding alone."""
    copies = {n for _, names in tensor_names(model).values() for n in names[1:]}
    return {k: v for k, v in full.items() if k not in copies}


def saving_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose save_pretrained writes the weights. transformers writes a multimodal wrapper's checkpoint
    under its legacy names (LLaVA: language_model.model.*) by reversing the conversion mapping it finds by class name
    on the module tree; FSDP2's subclass (FSDPLlavaForConditionalGeneration) finds none, and a ZeRO-3-loaded LLaVA
    wrote language_model.model.model.* (measured, tests/launch/test_sft_vlm_parity.py): a nested model is saved
    through a fresh meta-device instance of its own class instead (text models: the model itself)."""
    if not is_nested(getattr(model, "config", None)):
        return model
    cls = type(model)
    cls = next((b for b in cls.__bases__ if f"FSDP{b.__name__}" == cls.__name__), cls)
    with torch.device("meta"):
        fresh = cls._from_config(model.config)
    if getattr(model, "generation_config", None) is not None:
        fresh.generation_config = model.generation_config
    return fresh


def write_lora(backend, full: dict[str, torch.Tensor], output_dir: str, merge_adapter: bool) -> None:
    """The adapter (adapter_config.json + adapter_model.safetensors) or, merge_adapter, the merged model."""
    peft_model = backend.hf_model()  # a pipeline stage's PEFT model; None: the model Accelerate wraps
    model = unwrap(backend.model) if peft_model is None else peft_model
    if merge_adapter:
        merged_state_model(model, full).save_pretrained(output_dir, safe_serialization=True)
    elif peft_model is not None:  # PEFT picks the adapter's entries by walking the model: a complete one
        full_peft_model(model, full).save_pretrained(output_dir, safe_serialization=True)
    else:
        model.save_pretrained(output_dir, state_dict=full, safe_serialization=True)


def on_cpu(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in full.items()}
