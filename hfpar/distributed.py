"""Process groups and the Accelerator, on GPUs and on a CPU-only machine alike.

    accelerator = setup_accelerator(args)   # inside a script started by `accelerate launch`

Only when the script was started by a launcher (torchrun env present) and no CUDA device exists, Accelerate's
backend choice is wrapped for the duration of `Accelerator(...)`: a gloo process group of the launcher's world size,
the strategy the config asked for. Nothing installed is edited; on CUDA Accelerate runs untouched (NCCL).
why: docs/architecture.md#why-spine-and-launch
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs
from accelerate.utils import other as accelerate_other

from hfpar.config import ConfigError
from hfpar.precision import fp8


def _launched_by_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def needs_cpu_shim() -> bool:
    """True when a launcher started us and there is no CUDA device: Accelerate would go single-process."""
    return _launched_by_torchrun() and not torch.cuda.is_available()


@contextlib.contextmanager
def swapped(owner, name: str, value):
    """`owner.name = value` for the duration of the block, the original put back after (even on error).
    How hfpar steers Accelerate / DeepSpeed / torch calls at one point without editing what is installed."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield original
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def _cpu_backend():
    """Make Accelerate's state build a gloo group of the launcher's size and keep FSDP/DeepSpeed.

    Accelerate maps (launcher env, no CUDA) to DistributedType.NO. We answer its backend query with
    ("gloo", MULTI_GPU): it then calls `init_process_group("gloo")` (or DeepSpeed's
    `init_distributed("gloo")`), reads world size / rank from it, and upgrades MULTI_GPU to FSDP or
    DEEPSPEED exactly as it does on GPUs. The device is pinned to CPU through Accelerate's own
    ACCELERATE_TORCH_DEVICE, and ACCELERATE_BYPASS_DEVICE_MAP makes DDP wrap with device_ids=None,
    which is what DDP requires for CPU modules.
    """

    def _gloo_backend(self, cpu=False, sagemaker_dp=False, backend=None):  # noqa: ARG001
        return "gloo", DistributedType.MULTI_GPU

    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = "true"
    with swapped(PartialState, "_prepare_backend", _gloo_backend):
        yield


def restart_attempt() -> int:
    """torchrun's restart counter (0 on the first attempt and outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


@contextlib.contextmanager
def _store_per_restart_attempt(timeout: datetime.timedelta):
    """Give a restarted attempt of an elastic job (`--max_restarts N`) keys of its own in the launcher's store.

    On a restart, `init_process_group` (called by Accelerate or DeepSpeed) gets the launcher's store under a prefix
    unique to the attempt (hfpar's TP / DP / EP groups live under it too). First attempts and non-elastic launches
    are untouched. why: docs/architecture.md#why-spine-and-launch
    """
    attempt = restart_attempt()
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        yield
        return
    original = dist.init_process_group

    def init_with_attempt_store(
        backend=None, init_method=None, timeout=timeout, world_size=-1, rank=-1, store=None, **kwargs
    ):
        if store is None and init_method in (None, "env://"):
            world_size = world_size if world_size > 0 else int(os.environ["WORLD_SIZE"])
            rank = rank if rank >= 0 else int(os.environ["RANK"])
            agent = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
            )
            store, init_method = dist.PrefixStore(f"hfpar/restart_attempt_{attempt}", agent), None
        return original(
            backend, init_method=init_method, timeout=timeout, world_size=world_size, rank=rank, store=store, **kwargs
        )

    with swapped(dist, "init_process_group", init_with_attempt_store):
        yield


def gpus_per_node_problem() -> str | None:
    """One line when a launch starts more processes on this node than it has CUDA devices: Accelerate would put
    local rank i on cuda:i and the first collective fails with 'invalid device ordinal' (seen on a one-GPU H100
    machine with 2 processes). None when every process has a device, or when no CUDA device is visible (CPU + gloo)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not _launched_by_torchrun() or not torch.cuda.is_available() or per_node <= torch.cuda.device_count():
        return None
    n = torch.cuda.device_count()
    return (
        f"{per_node} processes per node but this machine shows {n} CUDA device(s) "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): launch --num_processes {n} "
        "per node, or set CUDA_VISIBLE_DEVICES='' to run every process on the CPU with gloo"
    )


def setup_accelerator(args, *, log_with=None, project_dir=None) -> Accelerator:
    """Build the Accelerator for the launched strategy (CPU-capable: see the module docstring). ConfigError (one
    line) before any process group exists when the node has fewer CUDA devices than processes."""
    problem = gpus_per_node_problem() or (fp8.torchao_problem() if fp8.requested() else None)
    if problem:  # without torchao Accelerate's own fp8 check fails in the constructor, with a traceback
        raise ConfigError(problem)
    handlers = [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=args.dist_timeout_s))]
    if fp8.requested():  # torchao's float8 (hfpar converts the model; the rest of the preflight checks the options)
        handlers.append(fp8.accelerate_handler(fp8.fp8_settings(args)))
    kwargs = dict(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=log_with,
        project_dir=project_dir,
        kwargs_handlers=handlers,
    )
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        # DeepSpeed reads its own timeout at init_distributed; keep it equal to ours.
        os.environ.setdefault("DEEPSPEED_TIMEOUT", str(max(1, args.dist_timeout_s // 60)))
    with _store_per_restart_attempt(datetime.timedelta(seconds=args.dist_timeout_s)):
        if needs_cpu_shim():
            if "OMP_NUM_THREADS" not in os.environ:  # as Accelerate does for MULTI_CPU: no oversubscription
                local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
            with _cpu_backend():
                return Accelerator(**kwargs)
        return Accelerator(**kwargs)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP / DeepSpeed / torch.compile wrappers (FSDP2 wraps in place: the module itself).
    Never imports deepspeed. why: docs/architecture.md#why-start-up-time"""
    ds = sys.modules.get("deepspeed")
    wrappers = (
        torch.nn.parallel.DistributedDataParallel,
        torch.nn.DataParallel,
        *((ds.DeepSpeedEngine,) if ds is not None and hasattr(ds, "DeepSpeedEngine") else ()),
    )
    while True:
        if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile
            model = model._orig_mod
        elif isinstance(model, wrappers):
            model = model.module
        else:
            return model


def without_deepspeed_import():
    """A block in which Accelerate's unwrap (reached by transformers' save_pretrained) does not import deepspeed
    when the run never did. why: docs/architecture.md#why-start-up-time"""
    if "deepspeed" in sys.modules:
        return contextlib.nullcontext()
    return swapped(accelerate_other, "is_deepspeed_available", lambda: False)


def gathered_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict:
    """Collective: Accelerate's full state dict (FSDP2 / ZeRO-3 shards gathered on the main process), reached
    without its deepspeed-importing unwrap on the paths that do not use DeepSpeed (see unwrap)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.get_state_dict(model)
    return accelerator.get_state_dict(unwrap(model), unwrap=False)


def configure_deepspeed(accelerator: Accelerator, args, dp: int) -> None:
    """hfpar's flags are the single source of truth for these DeepSpeed keys (dp: the data-parallel size)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    ds_cfg = accelerator.state.deepspeed_plugin.deepspeed_config
    ds_cfg["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_cfg["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    ds_cfg["train_batch_size"] = args.per_device_train_batch_size * args.gradient_accumulation_steps * dp
    ds_cfg["gradient_clipping"] = args.max_grad_norm if args.max_grad_norm > 0 else 0.0


def process_rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce_sum(value: float | int | torch.Tensor, device) -> torch.Tensor:
    """Sum a scalar over all ranks (float64, exact for token counts)."""
    t = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t
