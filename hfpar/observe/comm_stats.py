"""Bytes each rank hands to collectives, by collective type: counted by instrumentation, not estimated.

    from hfpar.observe.comm_stats import CommCounter
    counter = CommCounter().install()        # before the backend is set up (DeepSpeed caches functions)
    counter.watch_ddp(ddp_model)             # DDP's reducer calls C++ directly: routed through a comm hook
    counter.reset(); train_step(); counter.snapshot()
    # {"all_reduce": {"calls": 3, "payload": 9980416, "wire": 9980416.0}, "all_gather": {...}, ...}

`payload` is the size of the collective's full tensor (all-reduce: the tensor; all-gather: the gathered
output; reduce-scatter: the input; all-to-all: what this rank sends). `wire` is what this rank sends
with the bandwidth-optimal (ring / pairwise) algorithm: all-reduce 2(N-1)/N x payload, all-gather and
reduce-scatter (N-1)/N x payload, reduce (reduce-scatter + gather to the root) (N-1)/N x payload, all-to-all the bytes
addressed to other ranks, broadcast the payload on the source rank. That is the quantity the textbook formulas give (DDP
2 Phi (N-1)/N per step, ...). Point to point, "send": the tensors this rank sends in `batch_isend_irecv` (context
parallelism's overlapped ring), payload = wire (what it receives are its peers' sends). The lone isend / irecv are not
wrapped: P2POp checks its op by identity against torch's own functions.

Python-level collectives (FSDP2, DeepSpeed, hfpar's TP/EP layers, Accelerate) go
through `torch.distributed` functions, which are wrapped while installed; nested calls (a new-style
`all_gather_single` calling the deprecated `all_gather_into_tensor`) are counted once.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from hfpar.parallel.expert_parallel.moe import MoELayer

_KIND = {  # torch.distributed function -> (collective type, how to size it)
    "all_reduce": ("all_reduce", "first"),
    "all_gather_into_tensor": ("all_gather", "out"),
    "_all_gather_base": ("all_gather", "out"),
    "all_gather_single": ("all_gather", "out"),
    "all_gather": ("all_gather", "list_out"),
    "reduce_scatter_tensor": ("reduce_scatter", "in"),
    "_reduce_scatter_base": ("reduce_scatter", "in"),
    "reduce_scatter_single": ("reduce_scatter", "in"),
    "reduce_scatter": ("reduce_scatter", "list_in"),
    "all_to_all_single": ("all_to_all", "a2a"),
    "all_to_all": ("all_to_all", "list_a2a"),
    "broadcast": ("broadcast", "first"),
    "reduce": ("reduce", "first"),
    "batch_isend_irecv": ("send", "p2p"),  # point to point (context parallelism's overlapped ring): the sends
}
_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "reduce": lambda n: (n - 1) / n,
}


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _arg(args, kwargs, i: int, *names):
    if len(args) > i:
        return args[i]
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return None


class CommCounter:
    def __init__(self) -> None:
        self._local = threading.local()
        self._originals: dict[tuple[object, str], object] = {}
        self.reset()

    # ------------------------------------------------------------------ counting
    def reset(self) -> None:
        self.stats: dict[str, dict[str, float]] = {}

    def add(self, kind: str, payload: int, wire: float) -> None:
        s = self.stats.setdefault(kind, {"calls": 0, "payload": 0, "wire": 0.0})
        s["calls"] += 1
        s["payload"] += payload
        s["wire"] += wire

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {k: dict(v) for k, v in sorted(self.stats.items())}

    def wire_total(self) -> float:
        return sum(v["wire"] for v in self.stats.values())

    def _count(self, name: str, args, kwargs) -> None:
        kind, how = _KIND[name]
        if how == "p2p":  # batch_isend_irecv(p2p_op_list): what this rank sends goes on the wire whole
            sent = sum(
                _nbytes(op.tensor)
                for op in _arg(args, kwargs, 0, "p2p_op_list") or []
                if getattr(op.op, "__name__", "") == "isend"
            )
            if sent:
                self.add(kind, sent, float(sent))
            return
        group = kwargs.get("group")
        if group is None and name in ("all_reduce", "broadcast") and len(args) > 2:
            group = args[2]
        if group is None and name == "reduce" and len(args) > 3:  # reduce(tensor, dst, op, group)
            group = args[3]
        n = _group_size(group)
        if n <= 1:
            return
        if how == "first":
            payload = _nbytes(_arg(args, kwargs, 0, "tensor"))
        elif how == "out":
            payload = _nbytes(_arg(args, kwargs, 0, "output_tensor", "output"))
        elif how == "in":
            payload = _nbytes(_arg(args, kwargs, 1, "input_tensor", "input"))
        elif how == "list_out":
            payload = sum(_nbytes(t) for t in (_arg(args, kwargs, 0, "tensor_list") or []))
        elif how == "list_in":
            payload = sum(_nbytes(t) for t in (_arg(args, kwargs, 1, "input_list") or []))
        elif how == "list_a2a":
            ins = _arg(args, kwargs, 1, "input_tensor_list") or []
            me = dist.get_rank(group) if group is not None else dist.get_rank()
            self.add(kind, sum(_nbytes(t) for t in ins), sum(_nbytes(t) for i, t in enumerate(ins) if i != me))
            return
        else:  # all_to_all_single(output, input, output_split_sizes, input_split_sizes)
            inp = _arg(args, kwargs, 1, "input")
            splits = _arg(args, kwargs, 3, "input_split_sizes")
            payload = _nbytes(inp)
            me = dist.get_rank(group) if group is not None else dist.get_rank()
            if splits:
                row = payload // max(1, sum(splits))
                wire = (sum(splits) - splits[me]) * row
            else:
                wire = payload * (n - 1) / n
            self.add(kind, payload, wire)
            return
        if kind == "broadcast":
            src = _arg(args, kwargs, 1, "src")
            wire = float(payload) if src == dist.get_rank() else 0.0
        else:
            wire = payload * _FACTOR[kind](n)
        self.add(kind, payload, wire)

    # ------------------------------------------------------------------ installing
    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self._count(name, args, kwargs)
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        counted._hfpar_counted = True
        return counted

    def install(self) -> CommCounter:
        for module in (dist, c10d):
            for name in _KIND:
                fn = getattr(module, name, None)
                if fn is None or getattr(fn, "_hfpar_counted", False):
                    continue
                self._originals[(module, name)] = fn
                setattr(module, name, self._wrap(name, fn))
        return self

    def uninstall(self) -> None:
        for (module, name), fn in self._originals.items():
            setattr(module, name, fn)
        self._originals.clear()

    def watch_ddp(self, model) -> None:
        """DDP's reducer all-reduces its gradient buckets from C++, out of sight of the wrappers. With the
        stock all-reduce comm hook (same math: sum / world) the buckets go through `dist.all_reduce`."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(getattr(model, "process_group", None), allreduce_hook)


class StepCommLog:
    """--log_comm_bytes: this rank's bytes per optimizer step, by collective, plus the token copies expert-parallel
    MoE layers route to / receive from other ranks. Installed before the backend wraps the model (DeepSpeed keeps
    references to the collective functions)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.counter = CommCounter().install()
        self.moe = [m for m in model.modules() if isinstance(m, MoELayer) and m.ep_size > 1]

    def watch(self, wrapped: torch.nn.Module) -> None:
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            self.counter.watch_ddp(wrapped)

    def reset(self) -> None:
        self.counter.reset()
        for m in self.moe:
            m.routed_remote_rows = m.received_remote_rows = 0

    def record(self) -> dict:
        rec = {"comm": self.counter.snapshot(), "comm_wire_bytes": self.counter.wire_total()}
        if self.moe:  # summed over this rank's MoE layers (forward calls of the step)
            rec["moe_routed_remote_rows"] = sum(m.routed_remote_rows for m in self.moe)
            rec["moe_received_remote_rows"] = sum(m.received_remote_rows for m in self.moe)
        return rec
