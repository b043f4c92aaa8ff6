"""The mesh-independent form of a checkpoint: full tensors under the HF parameter names, for the model and for each
optimizer state, read from whatever layout wrote it. Resume on another mesh loads it through the new layout's own
sharding (the backends' load_full_state); `hfpar export` writes its model part.

    full = read_full_state(ckpt)               # FullState(model={name: tensor}, optim={name: {"exp_avg": ..., ...}})
    weights = read_full_state(ckpt, optimizer=False).model

Layouts read (each knows how its shards map to full tensors):
  rank files      rank<r>_of<world>.pt / tp_rank<t>_of<tp>.pt of the TP / EP / pipeline backends: each holds its local
                  tensors and their piece_layout (hfpar.parallel.pieces: ShardSpec, DTensor offsets, the HF name), so
                  the pieces join back offline; data-parallel replicas repeat pieces, taken once
  accelerate      model.safetensors + optimizer.bin (single, DDP, CP): the optimizer's parameter order is recorded
                  in optimizer_params.json (HF names) when the checkpoint is written
  dcp             FSDP2 (Accelerate's): torch.distributed.checkpoint read without a process group into full tensors
                  (the optimizer's state is keyed by parameter name already)
  deepspeed       ZeRO-1/2/3 (one model-parallel rank): DeepSpeed's flat fp32 partitions joined the way its
                  zero_to_fp32 joins the weights (its own functions), applied to exp_avg / exp_avg_sq as well
Every read runs inside safe_load.safe_loading() (the caller's): torch.load with weights_only=True, DCP's metadata
through the restricted unpickler. Per-rank files are read memory-mapped and each full tensor joined when asked for
(one at a time: Joined); the other layouts are read whole by each process (DeepSpeed's and DCP's readers).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    _EmptyStateDictLoadPlanner,  # as dcp_to_torch_save uses them
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from hfpar.checkpoint import layout
from hfpar.checkpoint.safe_load import CheckpointError
from hfpar.parallel.pieces import join_pieces

OPTIMIZER_PARAMS = "optimizer_params.json"  # HF names of optimizer.bin's parameter indices (accelerate layout)
WAY_OUT = "use the run's final model (its --output_dir), or resume it on the checkpoint's mesh"


@dataclass
class FullState:
    model: Mapping[str, torch.Tensor]
    optim: Mapping[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    kind: str = ""


class Joined(Mapping):
    """{name: full tensor} whose tensors are joined from their pieces when asked for, one at a time (not kept): a
    resume reads the per-rank files memory-mapped and holds one full parameter (and its pieces) at a time."""

    def __init__(self, pieces: dict, join):
        self.pieces, self.join = pieces, join

    def __getitem__(self, name: str):
        return self.join(self.pieces[name])

    def __contains__(self, name) -> bool:
        return name in self.pieces

    def __iter__(self):
        return iter(self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)


def read_full_state(ckpt: str | Path, optimizer: bool = True) -> FullState:
    """The checkpoint's full model (and optimizer) state under HF names; CheckpointError (one line) when its layout
    cannot be read into that form."""
    ckpt = Path(ckpt)
    if any(ckpt.glob("rank*_of*.pt")) or any(ckpt.glob("tp_rank*_of*.pt")):
        return _rank_files(ckpt, optimizer)
    kind = layout.model_state_kind(ckpt)
    if kind in ("safetensors", "bin"):
        return _accelerate(ckpt, kind, optimizer)
    if kind == "dcp":
        return _dcp(ckpt, optimizer)
    if kind == "deepspeed":
        state = layout.read_trainer_state(ckpt) if (ckpt / layout.STATE_FILE).is_file() else {}
        if (
            state.get("pp", 1) > 1 or state.get("tp", 1) > 1
        ):  # DeepSpeed with hfpar's mpu: partitions per stage / TP rank
            what = "pipeline stage" if state.get("pp", 1) > 1 else "tensor-parallel rank"
            raise CheckpointError(f"{ckpt}: DeepSpeed partitions per {what}, which have no full form: {WAY_OUT}")
        # here, not at the top: DeepSpeed is an optional dependency and its import takes seconds (1.5 s measured
        # after hfpar.preflight's imports on a 2-core CPU machine), which reading any other layout does not need
        from hfpar.checkpoint.zero_state import read_zero_state  # noqa: PLC0415

        try:
            model, optim = read_zero_state(ckpt, optimizer)
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError) as exc:  # a DeepSpeed folder missing its files: one line
            raise CheckpointError(
                f"{ckpt}: unreadable DeepSpeed checkpoint ({str(exc).splitlines()[0][:200]})"
            ) from None
        return FullState(model, optim, "deepspeed")
    raise CheckpointError(
        f"{ckpt}: no model state found (expected model.safetensors, pytorch_model_fsdp_0/, a DeepSpeed "
        "'latest' file or per-rank files); is it a checkpoint-<step> directory?"
    )


def _rank_files(ckpt: Path, optimizer: bool) -> FullState:
    files = sorted(ckpt.glob("rank*_of*.pt")) + sorted(ckpt.glob("tp_rank*_of*.pt"))
    pieces: dict[str, list] = {}
    opt_pieces: dict[str, dict[str, list]] = {}
    for f in files:
        saved = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        where = saved.get("layout")
        if where is None or "model" not in saved:
            raise CheckpointError(
                f"{f}: per-rank file without the piece layout (TP / EP x DeepSpeed, or an older "
                f"hfpar), which has no full form: {WAY_OUT}"
            )
        for key, t in saved["model"].items():
            pieces.setdefault(where[key]["name"], []).append((where[key], t))
        if optimizer:
            keys = saved["optimizer_keys"]
            for idx, st in saved["optimizer"]["state"].items():
                desc = where[keys[int(idx)]]
                for k, v in st.items():
                    opt_pieces.setdefault(desc["name"], {}).setdefault(k, []).append((desc, v))

    def join(p):
        try:
            return join_pieces(p)
        except ValueError as exc:
            raise CheckpointError(f"{ckpt}: per-rank files incomplete ({exc}); a file is missing") from None

    return FullState(
        Joined(pieces, join), Joined(opt_pieces, lambda st: {k: join(p) for k, p in st.items()}), "rank files"
    )


def _accelerate(ckpt: Path, kind: str, optimizer: bool) -> FullState:
    if kind == "safetensors":
        model = load_file(str(ckpt / "model.safetensors"))
    else:
        model = torch.load(ckpt / "pytorch_model.bin", map_location="cpu", weights_only=True)
    optim = {}
    if optimizer:
        names_file = ckpt / OPTIMIZER_PARAMS
        if not names_file.is_file():
            raise CheckpointError(
                f"{ckpt}: no {OPTIMIZER_PARAMS} (written by an older hfpar): its optimizer state "
                "cannot be matched to parameters on another mesh"
            )
        names = json.loads(names_file.read_text())
        saved = torch.load(ckpt / "optimizer.bin", map_location="cpu", weights_only=True)
        optim = {names[int(idx)]: dict(st) for idx, st in saved["state"].items()}
    return FullState(model, optim, "accelerate")


def _dcp_read(path: Path) -> dict:
    """A DCP directory into full tensors, without a process group (what dcp_to_torch_save does, kept in memory)."""
    state: dict = {}
    _load_state_dict(
        state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    return state


def _dcp(ckpt: Path, optimizer: bool) -> FullState:
    model = _dcp_read(ckpt / "pytorch_model_fsdp_0")
    model = model.get("model", model)  # Accelerate saves {"model": model.state_dict()}
    optim = {}
    if optimizer:
        opt_dir = ckpt / "optimizer_0"
        saved = _dcp_read(opt_dir)
        saved = saved.get("optimizer", saved)
        optim = {name: dict(st) for name, st in saved["state"].items()}
    return FullState(model, optim, "dcp")
