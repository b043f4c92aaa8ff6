"""The one write of a checkpoint (staged, fsynced, manifested, renamed, marked COMPLETE), its read, and retention.

    path = save_checkpoint(accelerator, "out", step, trainer_state, save_total_limit, extra=write_more, tokenizer=tok)
    state = load_checkpoint(accelerator, path)       # the trainer state; the rank files are the backend's to read
    apply_retention("out", limit=2)                  # older COMPLETE checkpoints hfpar wrote, never the newest good one

The Checkpointer (checkpointer.py) calls these; crash safety and what is read on load: its docstring.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import shutil
import sys
from pathlib import Path

from accelerate import Accelerator
from transformers import PreTrainedModel

from hfpar.checkpoint.layout import (
    MARKER,
    STATE_FILE,
    checkpoint_dir,
    is_hfpar_checkpoint,
    list_checkpoints,
    read_trainer_state,
    staging_dir,
    verified,
)
from hfpar.checkpoint.manifest import write_manifest
from hfpar.checkpoint.ownership import STAGING_MARK, is_staging, owned_names, record_written
from hfpar.checkpoint.safe_load import CheckpointError
from hfpar.distributed import all_reduce_sum, unwrap
from hfpar.parallel.expert_parallel import is_upcycled, upcycled_hf_config


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str,
    step: int,
    trainer_state: dict,
    save_total_limit: int | None,
    extra=None,
    tokenizer=None,
) -> Path:
    """Collective: every rank must call it; the one place a checkpoint is written. `extra(tmp_dir)` writes state
    Accelerate does not know (per-TP-rank shards). Returns the final checkpoint path."""
    final = checkpoint_dir(output_dir, step)
    tmp = staging_dir(output_dir, step)
    blocked = 0
    if accelerator.is_main_process:
        if is_staging(tmp):
            shutil.rmtree(tmp)  # our own leftover from a killed save (it holds hfpar's staging mark)
        if tmp.exists() or tmp.is_symlink():  # a user's folder, link or file of that name, since the claim: kept
            blocked = 1
            print(
                f"hfpar: warning: {tmp} is not a staging dir hfpar made (a user's folder, a link or a file): left "
                f"as it is, step {step} not saved",
                file=sys.stderr,
            )
        else:
            tmp.mkdir(parents=True)
            (tmp / STAGING_MARK).write_text(str(step))  # first: what tells hfpar's staging dir from a user's
    # every rank writes into tmp: they all learn whether the main process made it
    if all_reduce_sum(blocked, getattr(accelerator, "device", None)).item() > 0:
        return final
    with _disk_full_reported(tmp, step, accelerator.is_main_process):
        accelerator.save_state(str(tmp))
        if extra is not None:
            extra(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with _disk_full_reported(tmp, step, True):
            _finish_staging(accelerator, tmp, trainer_state, tokenizer)
        if final.exists() or final.is_symlink():
            if not is_hfpar_checkpoint(final):  # appeared during the run: never deleted nor written through
                shutil.rmtree(tmp)
                print(
                    f"hfpar: warning: {final} is not a checkpoint hfpar wrote (a user's folder, a link or a file): "
                    f"left as it is, step {step} not saved",
                    file=sys.stderr,
                )
                accelerator.wait_for_everyone()
                return final
            shutil.rmtree(final)  # same step saved again (e.g. resumed run re-saving): replace our own old copy
        os.replace(tmp, final)
        with open(final / MARKER, "w") as fh:
            fh.write(str(step))
            fh.flush()
            os.fsync(fh.fileno())
        (final / STAGING_MARK).unlink(missing_ok=True)
        apply_retention(output_dir, save_total_limit)  # (the newest is always kept: it needs no listing first)
        record_written(output_dir, add=(final.name,))  # this dir's hfpar run wrote it: a later retention may delete it
    accelerator.wait_for_everyone()
    return final


def _finish_staging(accelerator: Accelerator, tmp: Path, trainer_state: dict, tokenizer) -> None:
    """Main process, once every rank wrote its files: hfpar's own records, everything fsynced, the manifest last."""
    for pkl in tmp.glob("random_states_*.pkl"):  # Accelerate's pickled RNG: hfpar keeps its own (rank_state.py)
        pkl.unlink()
    (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2))
    _save_model_config(accelerator, tmp, tokenizer)
    _fsync_tree(tmp)
    write_manifest(tmp)


def load_checkpoint(accelerator: Accelerator, path: Path) -> dict:
    """Collective: Accelerate's state of a checkpoint loaded into the prepared objects; returns its trainer state."""
    accelerator.load_state(str(path))
    return read_trainer_state(path)


def apply_retention(output_dir: str, limit: int | None) -> None:
    """Keep the `limit` newest complete checkpoints (all when limit is 0 / None), and always the newest one that
    verifies (a damaged newer one never costs the last good state). Only checkpoints this output dir's hfpar runs
    wrote (its ledger, ownership.py) are deleted: one the user copied in (to resume from) is never."""
    if not limit:
        return
    ckpts = list_checkpoints(output_dir)
    keep = set(ckpts[-limit:])
    for path in reversed(ckpts):
        if verified(path) is None:
            keep.add(path)
            break
    written = owned_names(output_dir) or set()
    for old in ckpts:
        if old not in keep and old.name in written and is_hfpar_checkpoint(old):
            shutil.rmtree(old, ignore_errors=True)


class DiskFullError(CheckpointError):
    """No space left while writing a checkpoint (its staging dir is removed; earlier checkpoints are intact)."""


def _is_disk_full(exc: BaseException, where: Path) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch.save's C++ writer reports ENOSPC as "basic_ios::clear: iostream error" (a RuntimeError): ask the disk
    text = str(exc).lower()
    if isinstance(exc, RuntimeError) and ("iostream" in text or "no space" in text or "file write failed" in text):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(where.parent).free < 64 << 20
    return False


@contextlib.contextmanager
def _disk_full_reported(tmp: Path, step: int, remove: bool):
    """A full disk while saving: the staging dir removed (main process), one line saying so instead of a traceback."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        if not _is_disk_full(exc, tmp):
            raise
        if remove:
            shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(tmp.parent).free
        raise DiskFullError(
            f"disk full while saving checkpoint-{step} to {tmp.parent} ({free:,} bytes free): the "
            "partial save was removed and earlier checkpoints are intact; free space (or lower "
            "--save_total_limit) and relaunch with --resume_from_checkpoint latest"
        ) from None


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


def _save_wrapped_config(model, tmp: Path) -> None:
    """config.json of a model hfpar wraps itself (TP / EP / pipeline: Accelerate holds none), for the checkpoint's
    full form to load into on export: an upcycled model's HF MoE config, a pipeline stage's full model's config."""
    if hasattr(model, "full_model"):  # a pipeline stage (or a rank's chunks): the full model it was cut from
        full = model.full_model()
        model = full if is_upcycled(full) else model
    if is_upcycled(model):
        with contextlib.suppress(ValueError):  # not representable as an HF MoE (the final export says so): none
            upcycled_hf_config(model).save_pretrained(tmp)  # no architectures: export builds an AutoModelForCausalLM
        return
    # a pipeline stage (or a rank's chunks) holds the trimmed HF model(s) and the full model's config
    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)
    config = copy.deepcopy(getattr(model, "full_config", None) or getattr(hf, "config", None))
    if config is not None:
        config.architectures = [_hf_class(hf).__name__]
        config.save_pretrained(tmp)


def _hf_class(model) -> type:
    """The transformers class of a model (FSDP2 makes a subclass of it, FSDPLlamaForCausalLM)."""
    cls = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers") or c is object)
    return cls if cls is not object else type(model)


def _save_model_config(accelerator: Accelerator, tmp: Path, tokenizer) -> None:
    """config.json (and the tokenizer, when given) next to the state, so `hfpar export` needs the checkpoint only."""
    for model in accelerator._models[:1]:  # empty for TP / EP runs, which hfpar wraps itself
        unwrapped = unwrap(model)
        if hasattr(unwrapped, "get_base_model"):  # PEFT: record the base model's class, not PEFT's wrapper
            unwrapped = unwrapped.get_base_model()
        if hasattr(unwrapped, "config"):
            config = copy.deepcopy(unwrapped.config)
            config.architectures = [_hf_class(unwrapped).__name__]  # what save_pretrained records
            config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
