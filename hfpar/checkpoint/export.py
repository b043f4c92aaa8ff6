"""Turn a training checkpoint into a Hugging Face model directory, on one process, without a GPU.

    hfpar export out/run/checkpoint-500 out/run-step500     then AutoModelForCausalLM.from_pretrained("out/run-step500")

Verified against the checkpoint's manifest first, read without running code from it (safe_load.py).
Every checkpoint kind whose full form full_state.py reads: model.safetensors (single / DDP / CP runs),
pytorch_model_fsdp_0/ (FSDP2, torch.distributed.checkpoint), a DeepSpeed ZeRO-1/2/3 folder (its fp32 master
weights joined), and the per-rank files of TP / EP / pipeline runs (their pieces joined). The config and tokenizer come
from the checkpoint (hfpar saves
them there) or else from the run's output dir, the checkpoint's parent.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoProcessor, AutoTokenizer

from hfpar.checkpoint import layout
from hfpar.checkpoint.full_state import read_full_state
from hfpar.checkpoint.manifest import MANIFEST, symlink_problem, verify
from hfpar.checkpoint.safe_load import check_dcp_metadata, safe_loading
from hfpar.config import ConfigError
from hfpar.loading.sources import source_problems


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message is one line."""


def _verified(ckpt: Path) -> None:
    """A checkpoint hfpar wrote (COMPLETE / MANIFEST.json) is exported only if every file matches its manifest; with
    or without one, nothing is read through a symlink inside it (it could point anywhere on the disk)."""
    if problem := symlink_problem(ckpt):
        raise ExportError(problem)
    if (ckpt / MANIFEST).is_file() or (ckpt / layout.MARKER).is_file():
        problem = verify(ckpt)
        if problem is not None:
            raise ExportError(f"{ckpt}: damaged: {problem}")


def load_checkpoint_state_dict(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights of a checkpoint-<step> directory, HF parameter names: the model part of its
    full form (full_state.py), whatever layout wrote it."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise ExportError(f"{ckpt}: no such checkpoint directory")
    _verified(ckpt)
    try:
        check_dcp_metadata(ckpt)
        with safe_loading(ckpt):  # every torch.load weights_only, DCP's metadata through a restricted unpickler
            return read_full_state(ckpt, optimizer=False).model
    except ConfigError as exc:  # CheckpointError, or an untrusted trainer_state.json / DeepSpeed `latest`
        raise ExportError(str(exc)) from None


def _find(ckpt: Path, name: str) -> Path | None:
    for d in (ckpt, ckpt.parent):
        if (d / name).is_file():
            return d
    return None


def export_checkpoint(
    checkpoint_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False, trust_remote_code: bool = False
) -> str:
    """Write config.json, model.safetensors and tokenizer files to out_dir; returns a one-line summary. A non-empty
    out_dir is refused without overwrite; a config / tokenizer with auto_map (custom code) without
    trust_remote_code (no code of the checkpoint runs, none is copied)."""
    ckpt, out = Path(checkpoint_dir), Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        what = (
            "is not a directory"
            if not out.is_dir()
            else f"is not empty ({', '.join(sorted(p.name for p in out.iterdir())[:3])})"
        )
        raise ExportError(
            f"{out} {what}: pass --overwrite to write into it (files of the same names are replaced), "
            "or pick an empty or new OUT_DIR"
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: not a directory")
    cfg_dir = _find(ckpt, "config.json") if ckpt.is_dir() else None
    tok_dir = _find(ckpt, "tokenizer_config.json") if ckpt.is_dir() else None
    for d in {cfg_dir, tok_dir} - {None}:
        problems = source_problems(str(d), trust_remote_code=trust_remote_code, option="CHECKPOINT_DIR's files in")
        if problems:
            raise ExportError(problems[0])
    state = load_checkpoint_state_dict(ckpt)
    if cfg_dir is None:
        raise ExportError(f"{ckpt}: no config.json in the checkpoint nor in {ckpt.parent} (the run's output dir)")
    try:
        config = AutoConfig.from_pretrained(str(cfg_dir), trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - a config hfpar did not write (unknown model_type, bad values): one line
        raise ExportError(
            f"{cfg_dir / 'config.json'}: cannot be read ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    arch = (config.architectures or [None])[0]
    if arch and arch.startswith("FSDP") and not hasattr(transformers, arch):
        arch = arch[len("FSDP") :]  # FSDP2's wrapper subclass name
    cls = getattr(transformers, arch, None) if arch else transformers.AutoModelForCausalLM
    if cls is None:
        raise ExportError(f"{cfg_dir / 'config.json'}: unknown architecture {arch!r} for this transformers")
    with torch.device("meta"):
        model = cls._from_config(config) if arch else cls.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ExportError(f"{ckpt}: weights do not match {arch} (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if tied:
        model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    if tok_dir is not None:
        try:
            # a vision-language model's processor (its image processor, chat template and tokenizer) beside it
            auto = AutoProcessor if (tok_dir / "processor_config.json").is_file() else AutoTokenizer
            tokenizer = auto.from_pretrained(str(tok_dir), trust_remote_code=trust_remote_code)
        except Exception as exc:  # noqa: BLE001 - an untrusted file's parser: one line
            raise ExportError(
                f"{tok_dir}: the tokenizer cannot be read ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})"
            ) from None
        tokenizer.save_pretrained(str(out))
    try:
        step = layout.read_trainer_state(ckpt)["global_step"] if (ckpt / layout.STATE_FILE).exists() else "?"
    except ConfigError as exc:  # an untrusted file: one line
        raise ExportError(str(exc)) from None
    n = sum(t.numel() for t in state.values())
    return f"exported {ckpt} (step {step}, {n:,} parameters) to {out}" + (
        "" if tok_dir else "; no tokenizer files found, copy them yourself"
    )
