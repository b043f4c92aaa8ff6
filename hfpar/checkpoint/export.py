"""Turn a training checkpoint into a Hugging Face model directory, on one process, without a GPU.

    hfpar export out/run/checkpoint-500 out/run-step500     then AutoModelForCausalLM.from_pretrained("out/run-step500")

Verified against the checkpoint's manifest first, read without running code from it (safe_load.py).
Understands what Accelerate's save_state writes: model.safetensors (single / DDP / ZeRO-less runs),
pytorch_model_fsdp_0/ (FSDP2 sharded, torch.distributed.checkpoint) and a DeepSpeed ZeRO-1/2/3 folder
(its fp32 master weights are gathered). The config and tokenizer come from the checkpoint (hfpar saves
them there) or else from the run's output dir, the checkpoint's parent.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoConfig, AutoTokenizer

from hfpar.checkpoint import layout
from hfpar.checkpoint.manifest import MANIFEST, verify
from hfpar.checkpoint.safe_load import CheckpointError, check_dcp_metadata, safe_loading


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message is one line."""


def _verified(ckpt: Path) -> None:
    """A checkpoint hfpar wrote (COMPLETE / MANIFEST.json) is exported only if every file matches its manifest."""
    if (ckpt / MANIFEST).is_file() or (ckpt / layout.MARKER).is_file():
        problem = verify(ckpt)
        if problem is not None:
            raise ExportError(f"{ckpt}: damaged: {problem}")


def _dcp_state_dict(path: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), f"{tmp}/model.pt")
        state = torch.load(f"{tmp}/model.pt", map_location="cpu", weights_only=True)
    return state.get("model", state)  # Accelerate saves {"model": model.state_dict()}


def _zero_state_dict(ckpt: Path) -> dict:
    try:
        # an optional dependency (hfpar[deepspeed]), needed for ZeRO checkpoints only
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: PLC0415
    except ImportError:
        raise ExportError(f"{ckpt} is a DeepSpeed checkpoint: pip install hfpar[deepspeed] to export it") from None
    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


def load_checkpoint_state_dict(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights of a checkpoint-<step> directory, HF parameter names."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise ExportError(f"{ckpt}: no such checkpoint directory")
    _verified(ckpt)
    try:
        check_dcp_metadata(ckpt)
        with safe_loading(ckpt):  # every torch.load weights_only, DCP's metadata through a restricted unpickler
            return _state_dict(ckpt)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None


def _state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    # pipeline stages and per-rank shards first: a PP / TP / EP x ZeRO checkpoint also has DeepSpeed's `latest`,
    # whose state holds one stage's / rank 0's parameters only
    pp = layout.read_trainer_state(ckpt).get("pp", 1) if (ckpt / layout.STATE_FILE).is_file() else 1
    if pp > 1:
        raise ExportError(f"{ckpt} holds the {pp} stages of a pipeline-parallel run, which export cannot merge offline "
                          "yet: use the final model at the run's --output_dir, or resume the run with the same sizes")
    if layout.has_rank_shards(ckpt):
        raise ExportError(f"{ckpt} holds per-rank tensor/expert-parallel shards, which export cannot gather offline yet: "
                          "use the final model at the run's --output_dir, or resume the run with the same sizes")
    kind = layout.model_state_kind(ckpt)
    if kind == "safetensors":
        return load_file(str(ckpt / "model.safetensors"))
    if kind == "bin":
        return torch.load(ckpt / "pytorch_model.bin", map_location="cpu", weights_only=True)
    if kind == "dcp":
        return _dcp_state_dict(ckpt / "pytorch_model_fsdp_0")
    if kind == "deepspeed":
        return _zero_state_dict(ckpt)
    raise ExportError(f"{ckpt}: no model state found (expected model.safetensors, pytorch_model_fsdp_0/ or a "
                      "DeepSpeed 'latest' file); is it a checkpoint-<step> directory?")


def _find(ckpt: Path, name: str) -> Path | None:
    for d in (ckpt, ckpt.parent):
        if (d / name).is_file():
            return d
    return None


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path) -> str:
    """Write config.json, model.safetensors and tokenizer files to out_dir; returns a one-line summary."""
    ckpt, out = Path(checkpoint_dir), Path(out_dir)
    state = load_checkpoint_state_dict(ckpt)
    cfg_dir = _find(ckpt, "config.json")
    if cfg_dir is None:
        raise ExportError(f"{ckpt}: no config.json in the checkpoint nor in {ckpt.parent} (the run's output dir)")
    config = AutoConfig.from_pretrained(str(cfg_dir))
    arch = (config.architectures or [None])[0]
    if arch and arch.startswith("FSDP") and not hasattr(transformers, arch):
        arch = arch[len("FSDP"):]  # FSDP2's wrapper subclass name
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
    tok_dir = _find(ckpt, "tokenizer_config.json")
    if tok_dir is not None:
        AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(str(out))
    step = layout.read_trainer_state(ckpt).get("global_step") if (ckpt / layout.STATE_FILE).is_file() else "?"
    n = sum(t.numel() for t in state.values())
    return (f"exported {ckpt} (step {step}, {n:,} parameters) to {out}"
            + ("" if tok_dir else "; no tokenizer files found, copy them yourself"))
