"""Per-rank state of a checkpoint: the backends' tensors (save_rank_state / load_rank_state hooks) and each rank's RNG.

    torch.save({"model": local_state(model.state_dict())}, rank_state_file(ckpt_dir, ctx))
    load_local_state(model.state_dict(), saved["model"]); load_optimizer_state(optimizer, saved["optimizer"])
    save_rng(ckpt_dir, rank, accelerate_step); accelerate_step = load_rng(ckpt_dir, rank)

The per-rank .pt files hold tensors, numbers and strings only and are read with torch.load(weights_only=True)
(inside checkpoint.safe_load.safe_loading). The RNG state replaces Accelerate's random_states_<rank>.pkl (a pickle of
numpy objects, which weights_only refuses): a safetensors file of the generator states, with Python's and numpy's
scalars as JSON in its metadata; a missing or unreadable one fails the resume (the manifest caught it first).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor


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


def rng_file(ckpt_dir, rank: int) -> Path:
    return Path(ckpt_dir) / f"rng_state_{rank}.safetensors"


def save_rng(ckpt_dir, rank: int, accelerate_step: int) -> None:
    """This rank's Python, numpy, torch (CPU and every CUDA device) generator states, exactly."""
    version, py_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors = {
        "python": torch.tensor(py_state, dtype=torch.int64),
        "numpy": torch.from_numpy(np_keys.astype(np.int64)),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        for i, st in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = st
    meta = {
        "python_version": version,
        "python_gauss": gauss,
        "numpy_name": np_name,
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "accelerate_step": accelerate_step,
    }
    save_file(tensors, str(rng_file(ckpt_dir, rank)), metadata={"state": json.dumps(meta)})


_META = {  # hfpar's RNG metadata: each key and the types its value may have
    "python_version": (int,),
    "python_gauss": (float, type(None)),
    "numpy_name": (str,),
    "numpy_pos": (int,),
    "numpy_has_gauss": (int,),
    "numpy_gauss": (float, int),
    "accelerate_step": (int,),
}
_TENSORS = ("python", "numpy", "torch_cpu")


def rng_problem(path: Path) -> str | None:
    """Why path is not an RNG file hfpar wrote (its header and metadata, no tensor read), or None."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta, keys = fh.metadata(), set(fh.keys())  # noqa: SIM118  (safe_open has no __iter__)
    except Exception as exc:  # noqa: BLE001 - safetensors' own SafetensorError, OSError: an unreadable file, one line
        return f"{path}: not a safetensors file ({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})"
    try:
        state = json.loads((meta or {})["state"])
    except (KeyError, ValueError, TypeError):
        return f"{path}: no generator state in its metadata ('state': JSON); not hfpar's RNG file"
    if not isinstance(state, dict):
        return f"{path}: its 'state' metadata is not a JSON object; not hfpar's RNG file"
    bad = [k for k, types in _META.items() if isinstance(state.get(k), bool) or not isinstance(state.get(k), types)]
    missing = [k for k in _TENSORS if k not in keys]
    if bad or missing:
        what = ", ".join([*(f"state {k!r}" for k in bad), *(f"tensor {k!r}" for k in missing)])
        return f"{path}: missing or invalid {what}; not hfpar's RNG file"
    return None


def rng_accelerate_step(ckpt_dir, rank: int) -> int:
    """Accelerate's micro-step counter saved with rank's generators, without restoring them (another world size)."""
    with safe_open(str(rng_file(ckpt_dir, rank)), framework="pt") as fh:
        return int(json.loads(fh.metadata()["state"])["accelerate_step"])


def load_rng(ckpt_dir, rank: int) -> int:
    """Restores this rank's generators; returns Accelerate's micro-step counter saved with them. ValueError naming
    the file when it is not hfpar's (the preflight said so first: checkpoint_problems)."""
    if problem := rng_problem(rng_file(ckpt_dir, rank)):
        raise ValueError(problem)
    with safe_open(str(rng_file(ckpt_dir, rank)), framework="pt") as fh:
        meta = json.loads(fh.metadata()["state"])
        t = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118  (safe_open has no __iter__)
    random.setstate((meta["python_version"], tuple(int(x) for x in t["python"].tolist()), meta["python_gauss"]))
    np.random.set_state(
        (
            meta["numpy_name"],
            t["numpy"].numpy().astype(np.uint32),
            meta["numpy_pos"],
            meta["numpy_has_gauss"],
            meta["numpy_gauss"],
        )
    )
    torch.set_rng_state(t["torch_cpu"])
    cuda = [t[f"cuda_{i}"] for i in range(len(t)) if f"cuda_{i}" in t]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    return int(meta["accelerate_step"])
