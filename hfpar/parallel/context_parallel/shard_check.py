"""Does the model compute the same training when its rows are cut over the cp ranks? Decided by what the model does,
on its tiny copy, before the weights load:

    why = shard_problem(config)     # None, or one line naming the first module whose output differs

Context parallelism replaces the attention function (transformers' registry) with one that sees the whole row, and
feeds each rank its zigzag part of the row with the tokens' global position ids. probe.py checks that every
attention goes through the registry and mixing.py that nothing else mixes tokens; what neither sees is a model whose
attention is told more than the registry's arguments carry: a mask with its own content (Llama 4's chunked
attention, Doge's learned dynamic mask: context parallelism builds causal / document / window masks from the
positions and ignores the model's), or a computation that reads the local sequence instead of the position ids
(Llama 4's attention temperature from `cache_position`). Each trained something else under CP without a word (the
family sweep, benchmarks/context_parallel/family_sweep.py: relative differences 1.0-1.2 in gradients).

The check: the run's tiny float64 copy (hfpar.parallel.tiny_copy: its first layers, every kind of layer, windows and
chunks shrunk below a shard) runs two rows of 16 tokens (the second padded on the right, with its attention_mask, as
the collator pads; padding is neither compared nor in the loss) whole with its stock attention (SDPA, else eager),
and cut over two emulated cp ranks: threads of this process, each calling the model with its zigzag part of the rows
and their global position ids (what the trainer does), through hfpar's CP attention function (cp_attention_forward:
its dropout, MLA and window handling), whose exchange between the ranks is done in memory: K / V of the whole row
gathered, exact document-causal attention by blockwise.block_attention (the reference the ring and Ulysses kernels
are tested against). Every module's output at every position, the logits, and every parameter's gradient of a random
cotangent must agree within 1e-6 relative (1e-3 for a family that runs float32 only); the first module whose output
differs is named, else the first parameter. Token mixers outside the attention (mixing.token_mixers) run on the whole
rows as under CP (gathered.py, the all-gather done in memory too); their gradients, summed over the ranks' shares in
the mixer's own arithmetic, within NOISE_X times what one process shows summing them the same way (split_noise).
Milliseconds to a second, once per config.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from ..language_model import text_config
from ..tiny_copy import check_once, runnable
from .adapt import cp_adapt
from .attention import cp_rows, register_cp_attention
from .blockwise import block_attention
from .gathered import gather_mixers
from .layout import shard_batch, shift_labels
from .mixing import call_keys, in_layer, token_mixers

CP = 2  # emulated ranks
T = 16  # tokens per row: 4 chunks of 4, shards of 8 (the tiny copy's windows and chunks: 4)
PAD = 5  # right padding of the second row: inside the last chunk and the one before (both ranks hold some)
TOL64, TOL32 = 1e-6, 1e-3
# gradients where a mixer runs on the whole rows (gathered.py): each rank back-propagates its own positions through
# it and the shares are summed in the mixer's own arithmetic (transformers' gated-DeltaNet kernels compute in float32
# whatever the model's dtype). One process shows the same when it sums a gradient over two parts of the row (4.5e-2
# on a small gradient of Qwen3.5's tiny copy): a gradient may differ by NOISE_X times that (split_noise), a wrong
# gather or order moves it by O(1)
NOISE_X = 10.0
_WAIT_S = 60.0


class EmulatedGroup:
    """cp ranks as threads of one process: cp_attention_forward calls `attention` in place of the ring / Ulysses
    exchange; each thread's n-th attention call meets the other threads' n-th call (the same model code runs on
    every rank), and K / V of the whole row are gathered in memory (autograd flows back to every thread's shard)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=_WAIT_S)
        self.local = threading.local()
        self.slots: dict[int, list] = {}
        self.lock = threading.Lock()

    def run(self, fn, args: list) -> list:
        """fn(rank, *args[rank]) on `size` threads -> their results; the first exception re-raised."""
        out: list = [None] * self.size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            self.local.rank, self.local.calls = rank, 0
            try:
                out[rank] = fn(rank, *args[rank])
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller; the other ranks released
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        return out

    def _meet(self, x) -> list:
        """Every thread's `x` of its n-th exchange (this one's n), in rank order."""
        rank, call = self.local.rank, self.local.calls
        self.local.calls += 1
        with self.lock:
            slot = self.slots.setdefault(call, [None] * self.size)
        slot[rank] = x
        self.barrier.wait()
        return slot

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Tl, ...) -> (B, cp * Tl, ...) in rank order (gathered.py's all-gather), autograd to every thread."""
        return torch.cat(self._meet(x), dim=1)

    def attention(self, q, k, v, rows, group, scaling=None, *, window=None, softcap=None, sink=None) -> torch.Tensor:
        slot = self._meet((k, v))
        kf, vf = (torch.cat([s[i] for s in slot], dim=2) for i in (0, 1))  # rank order: rows.order
        return block_attention(
            q, kf, vf, rows.doc, rows.local, rows.order, scaling, window=window, softcap=softcap, sink=sink
        )


def shard_problem(config) -> str | None:
    """Why context parallelism would train `config`'s model differently from one process (one line naming the module
    or parameter), or None. A copy that cannot be built or run: why (the caller refuses with it)."""
    mixers, why = token_mixers(config)
    if why is not None:
        return why
    with torch.enable_grad():
        why = check_once("cp_shards", text_config(config), lambda m: _compare(m, mixers))
    if why is None or "when its rows are cut" in why:
        return why
    return f"whether it computes the same when its rows are cut could not be checked: {why}"


def _recorder(model: nn.Module, store: dict, rank):
    """Forward hooks recording every module's (B, T', ...) output per rank (`rank()`: this thread's), in the order
    the modules finish."""
    names = {id(m): n for n, m in model.named_modules()}

    def hook(mod, args, out):
        t = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            store.setdefault(rank(), []).append((names.get(id(mod), ""), mod, t.detach()))

    return [m.register_forward_hook(hook) for m in model.modules() if m is not model]


def _keyed(outputs: list) -> dict:
    """(module name, call index) -> (module, output): mixing.call_keys' keys."""
    return {key: (mod, t) for key, (_, mod, t) in zip(call_keys(outputs), outputs, strict=True)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1e-6): the floor keeps a gradient that is zero in exact arithmetic (a key bias under
    softmax's shift invariance: OPT, CTRL) from reading its rounding noise as a 100 % difference."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def _compare(model: nn.Module, mixers: tuple[str, ...] = ()) -> str | None:
    model = runnable(model)  # float32 where the family cannot run float64 (the shared copy left float64)
    dtype = next(model.parameters()).dtype
    tol = TOL64 if dtype == torch.float64 else TOL32
    ref, cp_model = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    vocab = min(model.get_input_embeddings().num_embeddings, getattr(model.config, "vocab_size", 0) or 10**9, 100)
    ids = torch.randint(3, vocab, (2, T), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T).expand(2, T)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, T - PAD :] = 0  # the second row padded on the right, as the collator pads (attention_mask 0)
    real = mask.bool()
    ref_out: dict = {}
    handles = _recorder(ref, ref_out, lambda: 0)
    try:
        logits = ref(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    # padding takes no part in the loss: its cotangent is 0, and no output is compared there
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=logits.dtype) * real[..., None]
    (logits * w).sum().backward()

    cp_model.set_attn_implementation(register_cp_attention())
    cp_adapt(cp_model)  # as enable_cp_attention does
    gather_mixers(cp_model, mixers)
    group = EmulatedGroup(CP)
    batch = shift_labels({"input_ids": ids, "labels": ids, "attention_mask": mask})
    shards = [shard_batch(batch, r, CP) for r in range(CP)]
    cp_out: dict = {}

    def rank_forward(rank: int, local: dict, rows) -> torch.Tensor:
        with cp_rows(rows, group, "ring"):
            kw = {k: local[k] for k in ("input_ids", "attention_mask", "position_ids")}
            return cp_model(**kw, use_cache=False).logits

    handles = _recorder(cp_model, cp_out, lambda: group.local.rank)
    try:
        shard_logits = group.run(rank_forward, shards)
    finally:
        for h in handles:
            h.remove()
    sum((lg * w[:, rows.local]).sum() for lg, (_, rows) in zip(shard_logits, shards, strict=True)).backward()
    # every module's output, the shards put back at their global positions
    per_rank = [_keyed(cp_out.get(r, [])) for r in range(CP)]
    for key, (mod, want) in _keyed(ref_out.get(0, [])).items():
        parts = [r.get(key) for r in per_rank]
        if want.shape[:2] != ids.shape or any(p is None or p[1].shape[:2] != (2, T // CP) for p in parts):
            continue  # not per token, or called differently: compared through what it feeds
        got = torch.empty_like(want)
        for (_, rows), (_, t) in zip(shards, parts, strict=True):
            got[:, rows.local] = t
        if (d := _rel(got[real], want[real])) > tol:
            return _named(*in_layer(ref, key[0], mod), d, tol)
    full = torch.empty_like(logits)
    for (_, rows), lg in zip(shards, shard_logits, strict=True):
        full[:, rows.local] = lg.detach()
    if (d := _rel(full[real], logits.detach()[real])) > tol:
        return _named("the model's logits", model, d, tol)
    noise = {}
    if mixers:
        run = lambda m: m(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits  # noqa: E731
        noise = split_noise(ref, run, w, [rows.local for _, rows in shards])
    for (name, p), q in zip(cp_model.named_parameters(), ref.parameters(), strict=True):
        if q.grad is None:
            continue
        g = torch.zeros_like(q.grad) if p.grad is None else p.grad
        if (d := _rel(g, q.grad)) > max(tol, NOISE_X * noise.get(name, 0.0)):
            return _named(f"the gradient of {name}", None, d, tol)
    return None


def split_noise(model: nn.Module, run, w: torch.Tensor, parts: list[torch.Tensor]) -> dict[str, float]:
    """name -> how far one process's gradient of sum(run(model) * w) (in model's .grad) moves when it is summed
    over `parts` of the row (each (T',) positions: w there only), relative: what a mixer's own arithmetic does to a
    gradient CP sums over the ranks' shares (gathered.py), with nothing cut. `run(m)`: m's (B, T, V) logits."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    for idx in parts:
        keep = torch.zeros(w.shape[1], dtype=w.dtype)
        keep[idx] = 1
        (run(m) * w * keep[None, :, None]).sum().backward()
    whole = dict(model.named_parameters())
    return {
        n: _rel(p.grad, whole[n].grad)
        for n, p in m.named_parameters()
        if p.grad is not None and whole[n].grad is not None
    }


def _named(name: str, mod: nn.Module | None, d: float, tol: float) -> str:
    what = f"{name} ({type(mod).__name__})" if mod is not None else name
    return (
        f"{what} differs by {d:.2g} relative (tolerance {tol:g}) when its rows are cut over the cp ranks (checked on "
        "a tiny copy, cp = 2): the model tells its attention more than positions and windows (a mask of its own: "
        "chunked attention, a learned bias) or reads the local sequence instead of the position ids"
    )
