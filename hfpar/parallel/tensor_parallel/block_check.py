"""A tensor-parallel plan checked numerically at apply time, on copies of the model's first decoder block (forward
and backward); the names and shapes were checked before, by shape_check.py.

    verify_first_block(model, assigned, shard_fn, tp_group, sequence_parallel=False, style_of=...)

Every plan apply_tensor_parallel accepts (written, derived from base_model_tp_plan, inferred, or the user's) is
checked here before the model is touched: the first block's real inputs are captured by running the model on
2 x T random token ids and stopping at the block (embedding, rotary and mask only: no other block runs), then
two float64 copies of that block (eval mode, so no dropout) run it unsharded and sharded by the plan on the same
inputs and the same random output cotangent. The output, the input gradient and every parameter gradient (shards
gathered, partial grads summed by the same hooks as the model's) must agree within 1e-6 relative; a wrong plan
differs by O(1) (a missing partial sum by ~50 %). Otherwise ValueError in one line naming the first module that
differs and its plan entry; the model is left unsharded. The same check runs on the first block of every other
block structure in the stack (hybrid families: linear-attention layers, dense and MoE layers) and on the last block;
under sequence parallelism those other blocks get this rank's T/tp tokens (block 0 splits T itself).

The copies run in float64 whatever the model's dtype (why: docs/architecture.md#why-the-parallel-layers); where the
device has no float64 (MPS), or a kernel of the block has none (transformers' grouped_mm experts of an MoE block), in
float32 with a 1e-3 tolerance.

Cost: two float64 copies of one block (peak: model + 2 blocks in fp64), one short forward up to the block, one
forward and backward of the block on 2 x T tokens (T = 8 rounded up to a multiple of tp) per copy, one all-gather
per sharded parameter of the block and one all-reduce; per block structure. Milliseconds on a tiny model; on a 7B
model on GPU well under a second, negligible beside the loading it follows. Weights on the meta device (the recipes'
sharded loading shards the skeleton before reading any weight): apply_tensor_parallel verifies the plan on a tiny
copy of the model instead (tiny_check.py); called here directly on meta, not verified (a warning), except with
probe_meta (an inferred plan: its candidates, e.g. a fused qkv's layouts, only a run at the real sizes tells apart):
the first block verified on a copy whose first block and everything outside the blocks are drawn at random, the same
on every rank (costs that much memory at load time: the embedding and head, the block in fp64 twice; TP after EP:
skipped as before); the other block structures are then checked on the tiny copy.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping

import psutil
import torch
import torch.distributed as dist
from torch import nn

from ..comm import all_reduce, group_rank, group_size
from ..errors import ParallelError
from ..sharding import ShardSpec, gather_shards, partial_grad_hooks, shard_spec
from .shape_check import REGIONS

__all__ = ["first_block_name", "verify_first_block"]

_TOL = {torch.float64: 1e-6, torch.float32: 1e-3}
_NO_FP64 = ("mps",)  # devices without float64 arithmetic: verified in float32


class _Captured(Exception):
    """Raised by the capture hook to stop the model's forward at the first block."""


def first_block_name(assigned: Mapping[str, str]) -> str | None:
    """The decoder block holding the plan's first TP region (`model.layers.0` for `model.layers.0.self_attn`)."""
    region = next((n for n, s in assigned.items() if s.partition(":")[0] in REGIONS), None)
    if region is None:
        return None
    parts = region.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i - 1].isdigit():
            return ".".join(parts[:i])
    return None


def _cast(obj, dtype):
    """A copy of the call's tensors in `dtype`, detached; those the model computed from its parameters (a relative
    position bias built once outside the blocks) are leaves that require grad: their gradients are checked too."""
    if isinstance(obj, torch.Tensor):
        if not obj.is_floating_point():
            return obj
        out = obj.detach().to(dtype)
        return out.requires_grad_() if obj.requires_grad else out
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


def _first_tensor(out) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((t for t in map(_first_tensor, out) if t is not None), None)
    return getattr(out, "last_hidden_state", None) if hasattr(out, "last_hidden_state") else None


def _capture(model: nn.Module, block: nn.Module, device, tp: int):
    """(args, kwargs) of the first block's call on 2 x T random ids (same on every rank: seeded generator)."""
    got: dict = {}

    def hook(mod, args, kwargs):
        got["call"] = (args, kwargs)
        raise _Captured

    emb = model.get_input_embeddings()
    t = tp * max(2, -(-8 // tp))
    ids = torch.randint(3, emb.num_embeddings, (2, t), generator=torch.Generator().manual_seed(1234)).to(device)
    flags = {m: m.training for m in model.modules()}
    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    model.eval()
    try:
        with torch.enable_grad():  # which of the block's inputs come from parameters (their gradients are checked)
            try:
                model(input_ids=ids, use_cache=False)
            except TypeError as e:
                if "use_cache" not in str(e):
                    raise
                model(input_ids=ids)
    except _Captured:
        pass
    finally:
        handle.remove()
        for m, f in flags.items():
            m.training = f
    return got.get("call")


def _split_hidden(args, kwargs):
    if args:
        return args[0], lambda x: ((x, *args[1:]), kwargs)
    return kwargs["hidden_states"], lambda x: (args, {**kwargs, "hidden_states": x})


def _signature(block: nn.Module) -> tuple:
    """What makes two blocks of a stack differently built: their modules' names and types, their parameters' shapes."""
    return (
        tuple((n, type(m).__name__) for n, m in block.named_modules()),
        tuple((n, tuple(p.shape)) for n, p in block.named_parameters()),
    )


def verify_first_block(
    model: nn.Module,
    assigned: Mapping[str, str],
    shard_fn: Callable,
    tp_group,
    *,
    sequence_parallel: bool = False,
    model_type: str | None = None,
    probe_meta: bool = False,
) -> float:
    """Refuse (ValueError, one line) when the plan's sharding of the first decoder block, of the first block of every
    other structure in the stack (hybrid layers), or of the last (some families build it differently:
    GPT-NeoX-Japanese's extra output bias) is not the unsharded block. shard_fn(root, assigned_relative) shards
    `root` in place exactly as apply_tensor_parallel shards the model. Returns the worst relative difference seen
    (0.0 when nothing was run). Weights on meta: skipped with a warning, or with probe_meta (an inferred plan, whose
    candidates only a run can tell apart) verified on a random-weight copy of the first block (_random_probe)."""
    name = first_block_name(assigned)
    if name is None:
        return 0.0
    parent, _, _ = name.rpartition(".")
    blocks = model.get_submodule(parent) if parent else None
    names = [name]
    if isinstance(blocks, nn.ModuleList) and len(blocks) > 1:
        seen = {_signature(model.get_submodule(name))}
        for i, b in enumerate(blocks):
            sig = _signature(b)
            if sig not in seen or i == len(blocks) - 1:
                seen.add(sig)
                names.append(f"{parent}.{i}")
    if any(p.is_meta for p in model.get_submodule(name).parameters()):  # a meta skeleton (sharded loading)
        if not probe_meta or any((shard_spec(p) or ShardSpec()).kind == "ep" for p in model.parameters()):
            warnings.warn(
                f"apply_tensor_parallel: the plan is not verified on {name} (weights on the meta device)", stacklevel=3
            )
            return 0.0
        need, free = _probe_bytes(model, parent, name), _free_bytes(tp_group)
        if need > free / 4:  # every rank of the node builds one: a quarter of what is free, at most
            warnings.warn(
                f"apply_tensor_parallel: the plan is not verified on {name} (weights on the meta device; a random-"
                f"weight copy of it would take {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free)",
                stacklevel=3,
            )
            return 0.0
        model, names = _random_probe(model, parent, name, tp_group), [name]
    worst = 0.0
    for block_name in dict.fromkeys(names):  # SP: block 0 splits T itself (sequence_scatter), the others get T/tp
        worst = max(
            worst,
            _verify_block(
                model,
                block_name,
                assigned,
                shard_fn,
                tp_group,
                sequence_parallel,
                sequence_parallel and block_name != name,
                model_type,
            ),
        )
    return worst


def _probe_bytes(model: nn.Module, blocks: str, first: str) -> int:
    """What _random_probe and the check of its first block hold: the parameters outside the blocks (not an untied LM
    head) in fp32, and the first block three times in float64 (the probe's, the reference and the sharded copy with
    their gradients)."""
    stack, block = model.get_submodule(blocks), model.get_submodule(first)
    in_blocks = {id(p) for b in stack for p in b.parameters()}
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and (emb is None or head.weight is not emb.weight):
        in_blocks |= {id(p) for p in head.parameters()}
    outside = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    return 4 * outside + 8 * 4 * sum(p.numel() for p in block.parameters())


def _free_bytes(tp_group) -> int:
    """Memory free where the probe runs: this rank's GPU under NCCL, else the host's available memory."""
    if dist.get_backend(tp_group) == "nccl":
        return torch.cuda.mem_get_info()[0]
    return psutil.virtual_memory().available


def _random_probe(model: nn.Module, blocks: str, first: str, tp_group) -> nn.Module:
    """A copy of a meta skeleton (the recipe's sharded loading applies TP before any weight is read) whose parameters
    outside the blocks and in the first block are drawn at random, the same on every rank: a plan's correctness is a
    matter of structure, not of values, so the first block is verified on it. The other blocks stay on meta (running
    up to them would need every block before them): apply_tensor_parallel checks them on a tiny copy."""
    probe = copy.deepcopy(model, _handles(model))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(tp_group) == "nccl" else None
    gen = torch.Generator().manual_seed(2024)
    stack = probe.get_submodule(blocks)
    skip = {id(m) for b in stack if b is not probe.get_submodule(first) for m in b.modules()}
    head, emb = probe.get_output_embeddings(), probe.get_input_embeddings()
    if head is not None and (emb is None or head.weight is not emb.weight):  # after the blocks: never run here
        skip.add(id(head))
    for m in probe.modules():
        if id(m) in skip:
            continue
        for n, p in list(m.named_parameters(recurse=False)):
            if p.is_meta:
                w = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                w = 1 + 0.1 * w if p.dim() == 1 else 0.05 * w  # norms' weights near 1, matrices small
                setattr(m, n, nn.Parameter(w.to(device=device, dtype=p.dtype), requires_grad=p.requires_grad))
        if device is not None:  # NCCL: the probe runs on this rank's GPU
            for n, b in list(m.named_buffers(recurse=False)):
                m._buffers[n] = b.to(device)
    return probe


def _verify_block(
    model: nn.Module,
    name: str,
    assigned: Mapping[str, str],
    shard_fn: Callable,
    tp_group,
    sequence_parallel: bool,
    split_input: bool,
    model_type: str | None,
) -> float:
    block = model.get_submodule(name)
    params = list(block.parameters())
    if not params or any(p.is_meta for p in params):
        warnings.warn(
            f"apply_tensor_parallel: the plan is not verified on {name} (weights on the meta device)", stacklevel=3
        )
        return 0.0
    try:
        call = _capture(model, block, params[0].device, group_size(tp_group))
    except Exception as e:  # noqa: BLE001 - a model this forward cannot drive is sharded unverified, with a warning
        call = None
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    else:
        why = "the model's forward never reached it"
    if call is None:
        warnings.warn(f"apply_tensor_parallel: the plan is not verified on {name} ({why})", stacklevel=3)
        return 0.0
    dtype = torch.float32 if params[0].device.type in _NO_FP64 else torch.float64
    try:
        ref_run = _reference(block, call, dtype)
    except Exception:  # a kernel without float64 (HF's grouped_mm experts): the block in float32
        if dtype == torch.float32:
            raise
        dtype = torch.float32
        ref_run = _reference(block, call, dtype)
    hidden, rebuild, seen_ref, out_ref, cot, ref_named, grads, learned = ref_run
    sharded = copy.deepcopy(block, _handles(block)).to(dtype).eval()
    rel = {
        n[len(name) + 1 :] if n != name else "": s for n, s in assigned.items() if n == name or n.startswith(name + ".")
    }
    shard_fn(sharded, rel)
    partial_grad_hooks(sharded.parameters())
    seen: list[tuple[str, torch.Tensor]] = []
    _record(sharded, lambda n, t: seen.append((n, t)))
    tp, rank = group_size(tp_group), group_rank(tp_group)
    x = (hidden.detach().chunk(tp, 1)[rank] if split_input else hidden.detach()).clone().requires_grad_()
    g_in = grads[0].chunk(tp, 1)[rank] if split_input and grads[0] is not None else grads[0]
    if sequence_parallel:  # the block's output is this rank's T/tp tokens
        out_ref, cot = out_ref.chunk(tp, 1)[rank], cot.chunk(tp, 1)[rank]
    stack: list[str] = []

    def leave(mod, args, out) -> None:  # returns None: the module's output is kept
        stack.pop()

    for n, m in sharded.named_modules():
        m.register_forward_pre_hook(lambda mod, args, n=n: stack.append(n))
        m.register_forward_hook(leave)
    try:
        out = _first_tensor(sharded(*rebuild(x)[0], **rebuild(x)[1]))
        out.backward(cot)
    except Exception as e:
        where = f"{name}.{stack[-1]}" if stack and stack[-1] else name
        err = ParallelError(
            "apply_tensor_parallel",
            [
                f"the tensor-parallel plan for model_type {model_type!r} breaks "
                f"{where} ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}; its plan "
                f"entry: {_entry(assigned, where)}); the model is left unsharded; pass "
                "plan={module pattern: style} or run without tensor parallelism"
            ],
        )
        err.module = where  # what apply_tensor_parallel may keep whole instead (a derived plan's region)
        raise err from e

    checks: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = [
        (f"{name} output", out.detach(), out_ref.detach()),
        (f"{name} input gradient", x.grad, g_in),
        # an input built from parameters outside the block: each rank's gradient must be whole (the parameters it
        # comes from are replicated), e.g. a per-head bias sliced to the rank's heads gathers its gradient back
        *(
            (f"{name} gradient of its input {i} (computed from parameters)", t.grad, g)
            for i, (t, g) in enumerate(learned)
        ),
    ]
    mine = dict(sharded.named_parameters())
    for (n, _), g_ref in zip(ref_named, grads[1:]):
        p = mine.get(n)
        g = None if p is None else p.grad
        spec = None if p is None else shard_spec(p)
        if g is not None and spec is not None and spec.kind == "tp" and spec.sharded:
            g = gather_shards(g, spec.dim, spec.group, spec.packed_splits)
        checks.append((f"{name}.{n} gradient", g, g_ref))
    errs = torch.tensor([_rel_err(a, b) for _, a, b in checks], dtype=torch.float64, device=out.device)
    errs = all_reduce(errs, tp_group, op=dist.ReduceOp.MAX)  # every rank decides the same
    tol = _TOL[dtype]
    bad = [(what, e) for (what, _, _), e in zip(checks, errs.tolist()) if not e <= tol]
    if bad:
        what, e = bad[0]
        module = (
            what.rsplit(" ", 1)[0].rpartition(".")[0]
            if what.endswith(" gradient") and "." in what[len(name) :]
            else name
        )
        if what == f"{name} output":  # the first submodule call (in execution order) whose full-shape output differs
            calls: dict[str, int] = {}  # a module called twice (Gemma-3n's altup router norm): matched call by call
            first = ""
            for n, t in seen:
                i = calls[n] = calls.get(n, -1) + 1
                r = seen_ref.get(n, [])[i] if i < len(seen_ref.get(n, [])) else None
                if r is not None and t.shape == r.shape and t.is_floating_point() and not _rel_err(t, r) <= tol:
                    first = n
                    break
            module = f"{name}.{first}" if first else name
        entry = _entry(assigned, module)
        err = ParallelError(
            "apply_tensor_parallel",
            [
                f"the tensor-parallel plan for model_type {model_type!r} does not "
                f"reproduce the unsharded {name} on random inputs: {what} differs by {e:.2g} relative "
                f"(tolerance {tol:g}; module {module}, its plan entry: {entry}); the model is left unsharded; pass "
                f"plan={{module pattern: style}} or run without tensor parallelism"
            ],
        )
        err.module = module
        raise err
    return max(errs.tolist(), default=0.0)


def _reference(block: nn.Module, call, dtype):
    """The unsharded copy's run in `dtype`: (hidden, rebuild, recorded outputs, output, cotangent, named params,
    grads of [input] + params, [(input computed from parameters, its grad)])."""
    args, kwargs = _cast(call, dtype)
    hidden, rebuild = _split_hidden(args, kwargs)
    ref = copy.deepcopy(block, _handles(block)).to(dtype).eval()
    seen_ref: dict[str, list[torch.Tensor]] = {}
    _record(ref, lambda n, t: seen_ref.setdefault(n, []).append(t))
    x_ref = hidden.detach().clone().requires_grad_()
    out_ref = _first_tensor(ref(*rebuild(x_ref)[0], **rebuild(x_ref)[1]))
    cot = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(4321), dtype=dtype).to(out_ref.device)
    ref_named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    learned = [t for t in _leaves((args, kwargs)) if t.requires_grad and t is not hidden]
    n = 1 + len(ref_named)
    grads = torch.autograd.grad(out_ref, [x_ref, *(p for _, p in ref_named), *learned], cot, allow_unused=True)
    return hidden, rebuild, seen_ref, out_ref, cot, ref_named, grads[:n], list(zip(learned, grads[n:]))


def _leaves(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _leaves(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _leaves(o)]
    return []


def _entry(assigned: Mapping[str, str], module: str) -> str:
    return next((repr(s) for n, s in assigned.items() if n == module), "none (replicated)")


def _record(block: nn.Module, put: Callable) -> None:
    """Forward hooks putting (relative name, first output tensor) of every submodule of a verification copy."""
    for n, m in block.named_modules():
        if n:
            m.register_forward_hook(
                lambda mod, args, out, n=n: None if _first_tensor(out) is None else put(n, _first_tensor(out).detach())
            )


def _rel_err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max |a - b| / max(max |b|, 1e-5) (the floor: a gradient that is zero in exact arithmetic, e.g. a key bias
    under softmax's shift invariance, is rounding noise on both sides); a gradient missing on one side only counts
    as a full difference."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        other = b if a is None else a
        return other.abs().max().item() / 1e-5
    if a.shape != b.shape:
        return float("inf")
    return (a.double() - b.double()).abs().max().item() / max(b.abs().max().item(), 1e-5)


def _handles(block: nn.Module) -> dict:
    """deepcopy memo that keeps process groups shared: an expert-parallel block (TP after EP) holds its groups on
    its modules and in its parameters' ShardSpecs, and a ProcessGroup cannot be copied (nor should it be)."""
    memo: dict = {}
    for obj in (*block.modules(), *block.parameters()):
        for value in vars(obj).values():
            inner = vars(value).values() if hasattr(value, "__dict__") and not isinstance(value, nn.Module) else ()
            for x in (value, *inner):
                if isinstance(x, dist.ProcessGroup):
                    memo[id(x)] = x
    return memo
