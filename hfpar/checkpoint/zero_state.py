"""A DeepSpeed ZeRO-1/2/3 checkpoint (one model-parallel rank: Accelerate's plain ZeRO runs) as full tensors under
the HF names: the fp32 master weights and AdamW's exp_avg / exp_avg_sq / step.

    model, optim = read_zero_state(ckpt)          # inside safe_load.safe_loading(): every torch.load weights_only

DeepSpeed keeps each state as flat partitions, one per data-parallel rank and parameter group (ZeRO-1/2: the group's
parameters concatenated then cut in dp pieces; ZeRO-3: each parameter cut in dp pieces). Its zero_to_fp32 joins the
fp32 weights back (`_zero2_merge_trainable_params`, `_zero3_merge_trainable_params`); the optimizer states have the
same flat layout as those weights, so the same functions join them: DeepSpeed's own code, fed another flat tensor.
DeepSpeed's universal checkpoint (ds_to_universal) would do this too, but writes one pickled file per parameter and
state, and is not aware of hfpar's TP (a TP x ZeRO checkpoint is refused here in one line).
"""

from __future__ import annotations

import contextlib
import io
import re
from collections import OrderedDict
from pathlib import Path

import torch

from hfpar.checkpoint.layout import deepspeed_tag
from hfpar.checkpoint.safe_load import CheckpointError
from hfpar.config import ConfigError

try:  # an optional dependency (hfpar[deepspeed]), needed for ZeRO checkpoints only
    from deepspeed.utils import zero_to_fp32 as z
except ImportError:  # pragma: no cover  (the CI installs it)
    z = None


def read_zero_state(ckpt: Path, optimizer: bool = True) -> tuple[dict, dict]:
    if z is None:
        raise CheckpointError(f"{ckpt} is a DeepSpeed checkpoint: pip install hfpar[deepspeed] to read it")
    try:
        ds_dir = deepspeed_tag(ckpt)  # `latest` is untrusted: a plain folder name inside ckpt, nothing else
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    model_files = z.get_model_state_files(str(ds_dir))
    mp_ranks = {m.group(1) for f in model_files if (m := re.search(r"mp_rank_(\d+)", Path(f).name))}
    if len(mp_ranks) > 1:
        raise CheckpointError(
            f"{ckpt}: a DeepSpeed checkpoint of {len(mp_ranks)} model-parallel ranks (TP or "
            "pipeline x ZeRO): resume it on the mesh that wrote it"
        )
    # zero_to_fp32 prints its progress (and tqdm bars) on every process
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        states = z.parse_model_states(model_files)
        sds = [
            torch.load(f, map_location="cpu", weights_only=True, mmap=True)["optimizer_state_dict"]
            for f in z.get_optim_files(str(ds_dir))
        ]
        stage = int(sds[0]["zero_stage"])
        world = sds[0]["partition_count"]
        world = max(world) if isinstance(world, list) else int(world)
        pads = sds[0].get("param_alignment_paddings")
        if stage <= 2:
            model = z._get_fp32_state_dict_from_zero2_checkpoint(
                world, [sd["single_partition_of_fp32_groups"] for sd in sds], states, False, pads
            )
        else:
            model = z.to_torch_tensor(
                z._get_fp32_state_dict_from_zero3_checkpoint(
                    world, [sd["fp32_flat_groups"] for sd in sds], states, False
                )
            )
        optim = _optimizer_states(sds, stage, world, states, pads) if optimizer else {}
    return {k: v.detach().clone() for k, v in model.items()}, optim


def _group_states(sd: dict, stage: int) -> list[dict]:
    """This rank's AdamW state per flat group (ZeRO-1/2: per parameter group, padding cut to the unpadded
    partition; ZeRO-3: per sub-group, in the order of fp32_flat_groups)."""
    if stage <= 2:
        base = sd["base_optimizer_state"]
        flats = sd["single_partition_of_fp32_groups"]
        if isinstance(base, list):  # DeepSpeed's elastic form: already one lean state per group
            return base
        return [
            {
                k: (v[: flats[i].numel()] if torch.is_tensor(v) and v.dim() > 0 else v)
                for k, v in base["state"][g["params"][0]].items()
            }
            for i, g in enumerate(base["param_groups"])
        ]
    opt = sd["optimizer_state_dict"]
    order = [i for g in opt["param_groups"] for i in g["params"]]
    return [opt["state"][i] for i in order]


def _optimizer_states(sds: list[dict], stage: int, world: int, states, pads) -> dict[str, dict[str, torch.Tensor]]:
    per_rank = [_group_states(sd, stage) for sd in sds]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key in ("exp_avg", "exp_avg_sq"):
        flat = [[g[key] for g in groups] for groups in per_rank]
        merged: OrderedDict = OrderedDict()
        if stage <= 2:
            z._zero2_merge_trainable_params(merged, world, flat, states, pads)
        else:
            z._zero3_merge_trainable_params(merged, world, flat, states)
            merged = z.to_torch_tensor(merged)
        for name, t in merged.items():
            out.setdefault(name, {})[key] = t.clone()
    step = per_rank[0][0]["step"]
    for st in out.values():
        st["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
    return out
