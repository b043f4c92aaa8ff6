"""hfpar.parallel.tensor_parallel against single-process nn.Linear / nn.Embedding / F.cross_entropy.

One start per world size (TP=2 and TP=4 gloo ranks on CPU) runs every check: outputs, input
gradients and gathered weight gradients within 1e-5 (float64, plus one float32 cross-entropy),
with and without sequence parallelism. Every rank holds the same reference model and batch
(same seed), like TP ranks in training.
"""

from __future__ import annotations

import io
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hfpar.parallel.sharding import shard_spec
from hfpar.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_shards,
    shard_tensor,
    tp_sharded_parameters,
    vocab_parallel_cross_entropy,
)
from tests.helpers.dist import run_distributed

B, T, H, OUT, V = 2, 8, 8, 16, 16  # T, OUT, V divisible by 4
PACKED = [8, 4, 4]  # e.g. q, k, v parts of a fused (16, H) weight
TOL = 1e-5


def _close(got, want, what, tol=TOL):
    assert got is not None, f"{what}: is None"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol, f"{what}: max abs error {err:.3g}"


def _seq_chunk(t, rank, tp):
    return t.chunk(tp, 1)[rank]


def _check_output_and_backward(y, y_ref, w_out, sp, rank, tp, what):
    """Compare a layer output with the reference (this rank's sequence chunk under SP), then backprop
    the matching slice of the same output weights."""
    if sp:
        _close(y, _seq_chunk(y_ref, rank, tp), f"{what} output (B, T/tp, H)")
        (y * _seq_chunk(w_out, rank, tp)).sum().backward()
    else:
        _close(y, y_ref, f"{what} output")
        (y * w_out).sum().backward()


def _check_column(rank, tp, group, dt):
    n = 0
    for bias, gather_output, sp, packed in itertools.product(
        (True, False), (False, True), (False, True), (None, PACKED)
    ):
        what = f"Column(bias={bias}, gather_output={gather_output}, sp={sp}, packed={packed})"
        torch.manual_seed(10)
        ref = nn.Linear(H, OUT, bias=bias, dtype=dt)
        x = torch.randn(B, T, H, dtype=dt)
        w_out = torch.randn(B, T, OUT, dtype=dt)  # loss = sum(y * w_out)
        layer = ColumnParallelLinear.from_linear(
            ref, group, packed_splits=packed, gather_output=gather_output, sequence_parallel=sp
        )
        xr = x.clone().requires_grad_()
        y_ref = ref(xr)
        (y_ref * w_out).sum().backward()

        xl = (_seq_chunk(x, rank, tp) if sp else x).clone().requires_grad_()  # (B, T/tp, H) under SP
        y = layer(xl)
        if gather_output:
            _close(y, y_ref, f"{what} output")
            (y * w_out).sum().backward()  # replicated loss
        else:
            _close(y, shard_tensor(y_ref.detach(), -1, rank, tp, packed), f"{what} output shard")
            (y * shard_tensor(w_out, -1, rank, tp, packed)).sum().backward()  # partial loss per rank
        _close(xl.grad, _seq_chunk(xr.grad, rank, tp) if sp else xr.grad, f"{what} input grad")
        _close(gather_shards(layer.weight.grad, 0, group, packed), ref.weight.grad, f"{what} weight grad")
        if bias:
            _close(gather_shards(layer.bias.grad, 0, group, packed), ref.bias.grad, f"{what} bias grad")
        _close(layer.full_weight(), ref.weight.detach(), f"{what} full_weight", 0.0)
        n += 1
    return n


def _check_row(rank, tp, group, dt):
    n = 0
    for bias, input_is_parallel, sp in itertools.product((True, False), (True, False), (False, True)):
        if sp and not input_is_parallel:
            continue
        what = f"Row(bias={bias}, input_is_parallel={input_is_parallel}, sp={sp})"
        torch.manual_seed(11)
        ref = nn.Linear(OUT, H, bias=bias, dtype=dt)
        x = torch.randn(B, T, OUT, dtype=dt)
        w_out = torch.randn(B, T, H, dtype=dt)
        layer = RowParallelLinear.from_linear(ref, group, input_is_parallel=input_is_parallel, sequence_parallel=sp)
        xr = x.clone().requires_grad_()
        y_ref = ref(xr)
        (y_ref * w_out).sum().backward()

        xl = (x.chunk(tp, -1)[rank] if input_is_parallel else x).clone().requires_grad_()
        y = layer(xl)
        _check_output_and_backward(y, y_ref, w_out, sp, rank, tp, what)
        _close(xl.grad, xr.grad.chunk(tp, -1)[rank] if input_is_parallel else xr.grad, f"{what} input grad")
        _close(gather_shards(layer.weight.grad, 1, group), ref.weight.grad, f"{what} weight grad")
        if bias:
            _close(layer.bias.grad, ref.bias.grad, f"{what} bias grad (replicated, every rank)")
        _close(layer.full_weight(), ref.weight.detach(), f"{what} full_weight", 0.0)
        n += 1
    return n


def _check_mlp_sp(rank, tp, group, dt):
    """Embedding -> Column -> gelu -> Row, all sequence-parallel, vs the plain model."""
    n = 0
    for sp in (False, True):
        torch.manual_seed(12)
        emb, up, down = nn.Embedding(V, H, dtype=dt), nn.Linear(H, OUT, dtype=dt), nn.Linear(OUT, H, dtype=dt)
        ids = torch.randint(0, V, (B, T))
        w_out = torch.randn(B, T, H, dtype=dt)
        (down(F.gelu(up(emb(ids)))) * w_out).sum().backward()
        p_emb = VocabParallelEmbedding.from_embedding(emb, group, sequence_parallel=sp)
        p_up = ColumnParallelLinear.from_linear(up, group, sequence_parallel=sp)
        p_down = RowParallelLinear.from_linear(down, group, sequence_parallel=sp)
        y = p_down(F.gelu(p_up(p_emb(ids))))  # (B, T/tp, H) under SP
        (y * (_seq_chunk(w_out, rank, tp) if sp else w_out)).sum().backward()
        for name, p_mod, mod, dim in (("emb", p_emb, emb, 0), ("up", p_up, up, 0), ("down", p_down, down, 1)):
            _close(gather_shards(p_mod.weight.grad, dim, group), mod.weight.grad, f"mlp sp={sp} {name} weight grad")
        _close(gather_shards(p_up.bias.grad, 0, group), up.bias.grad, f"mlp sp={sp} up bias grad")
        _close(p_down.bias.grad, down.bias.grad, f"mlp sp={sp} down bias grad")
        n += 1
    return n


def _check_embedding(rank, tp, group, dt):
    n = 0
    for padding_idx, sp in itertools.product((None, 5, -1), (False, True)):
        what = f"Embedding(padding_idx={padding_idx}, sp={sp})"
        torch.manual_seed(13)
        ref = nn.Embedding(V, H, padding_idx=padding_idx, dtype=dt)
        ids = torch.randint(0, V, (B, T))
        ids[0, :3] = 5
        ids[1, -2:] = V - 1
        w_out = torch.randn(B, T, H, dtype=dt)
        layer = VocabParallelEmbedding.from_embedding(ref, group, sequence_parallel=sp)
        y_ref = ref(ids)
        (y_ref * w_out).sum().backward()
        y = layer(ids)
        _check_output_and_backward(y, y_ref, w_out, sp, rank, tp, what)
        _close(gather_shards(layer.weight.grad, 0, group), ref.weight.grad, f"{what} weight grad")
        _close(layer.full_weight(), ref.weight.detach(), f"{what} full_weight", 0.0)
        assert layer.to_embedding().padding_idx == ref.padding_idx
        n += 1
    return n


def _check_cross_entropy(rank, tp, group):
    n = 0
    cases = itertools.product((torch.float64, torch.float32), (0.0, 0.1), ("mean", "sum", "none"), (-100, 3))
    for dt, eps, reduction, ignore_index in cases:
        what = f"CE(dtype={dt}, label_smoothing={eps}, reduction={reduction}, ignore_index={ignore_index})"
        torch.manual_seed(14)
        logits = (3 * torch.randn(B, T, V)).to(dt)
        target = torch.randint(0, V, (B, T))
        target[0, :2] = ignore_index  # ignored positions
        target[1, 0] = 3  # ignored too when ignore_index == 3
        lr = logits.clone().requires_grad_()
        ref = F.cross_entropy(
            lr.flatten(0, 1), target.flatten(), ignore_index=ignore_index, label_smoothing=eps, reduction=reduction
        )
        if reduction == "none":
            ref = ref.view(B, T)
        g = torch.randn(ref.shape, dtype=dt)
        (ref * g).sum().backward()  # (not ref.backward(g): lazily imports sympy, ~3 s per rank)

        ls = logits.chunk(tp, -1)[rank].clone().requires_grad_()  # (B, T, V/tp)
        loss = vocab_parallel_cross_entropy(
            ls, target, group=group, ignore_index=ignore_index, label_smoothing=eps, reduction=reduction
        )
        _close(loss, ref, f"{what} loss")
        (loss * g).sum().backward()
        assert ls.grad.dtype == dt
        _close(gather_shards(ls.grad, -1, group), lr.grad, f"{what} logits grad")
        n += 1
    # the backward runs once (its saved softmax becomes the gradient in place)
    ls = torch.randn(4, V // tp, dtype=torch.float64, requires_grad=True)
    loss = vocab_parallel_cross_entropy(ls, torch.tensor([0, 1, 2, V - 1]), group=group)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()
    return n + 1


def _check_construction(rank, tp, group):
    # direct construction draws the same numbers as the nn layer under the same seed
    torch.manual_seed(0)
    ref_l = nn.Linear(H, OUT)
    torch.manual_seed(0)
    col = ColumnParallelLinear(H, OUT, group=group)
    _close(col.full_weight(), ref_l.weight.detach(), "Column init", 0.0)
    _close(col.full_bias(), ref_l.bias.detach(), "Column init bias", 0.0)
    torch.manual_seed(0)
    row = RowParallelLinear(H, OUT, group=group)
    _close(row.full_weight(), ref_l.weight.detach(), "Row init", 0.0)
    torch.manual_seed(0)
    ref_e = nn.Embedding(V, H, padding_idx=2)
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(V, H, padding_idx=2, group=group)
    _close(emb.full_weight(), ref_e.weight.detach(), "Embedding init", 0.0)
    assert all(
        p.requires_grad
        for m in (col, row, emb, RowParallelLinear(H, OUT, group=group, device="meta"))
        for p in m.parameters()
    )
    frozen = nn.Linear(H, OUT)
    frozen.weight.requires_grad_(False)  # a frozen base weight stays frozen
    col_f = ColumnParallelLinear.from_linear(frozen, group)
    assert not col_f.weight.requires_grad and col_f.bias.requires_grad
    # TP tags: sharded params carry dim + group; the row bias is replicated (no tag)
    assert shard_spec(col.weight).dim == 0 and shard_spec(col.bias).dim == 0
    assert shard_spec(row.weight).dim == 1 and shard_spec(row.bias) is None
    assert shard_spec(emb.weight).group is group and shard_spec(emb.weight).size == tp
    assert tuple(col.weight.shape) == (OUT // tp, H) and tuple(row.weight.shape) == (OUT, H // tp)
    model = nn.Sequential(emb, col, row)
    found = {n: i.dim for n, _, i in tp_sharded_parameters(model)}
    assert found == {"0.weight": 0, "1.weight": 0, "1.bias": 0, "2.weight": 1}, found
    buf = io.BytesIO()
    torch.save(col.weight, buf)  # the tag pickles (without the group)
    assert shard_spec(torch.load(io.BytesIO(buf.getvalue()), weights_only=False)).dim == 0
    # packed weights: each rank takes its slice of EACH part; export restores the original order
    fused = nn.Linear(H, OUT)
    qkv = ColumnParallelLinear.from_linear(fused, group, packed_splits=PACKED)
    want = torch.cat([p.chunk(tp, 0)[rank] for p in fused.weight.detach().split(PACKED, 0)], 0)
    _close(qkv.weight, want, "packed shard", 0.0)
    exported = qkv.to_linear()
    _close(exported.weight, fused.weight.detach(), "packed export weight", 0.0)
    _close(exported.bias, fused.bias.detach(), "packed export bias", 0.0)
    # meta-device source works (weights loaded later)
    meta = nn.Linear(H, OUT, device="meta")
    assert ColumnParallelLinear.from_linear(meta, group, packed_splits=PACKED).weight.is_meta
    assert RowParallelLinear.from_linear(meta, group).bias.is_meta
    # indivisible sizes fail, naming the layer and the numbers
    bad = 6 * tp + 2 if tp > 2 else 7
    with pytest.raises(ValueError, match=rf"VocabParallelEmbedding.*num_embeddings \(vocab size\)={bad}.*size {tp}"):
        VocabParallelEmbedding(bad, H, group=group)
    with pytest.raises(ValueError, match=rf"model.lm_head: out_features={bad}.*{tp}"):
        ColumnParallelLinear.from_linear(nn.Linear(H, bad), group, name="model.lm_head")
    with pytest.raises(ValueError, match=rf"RowParallelLinear.*in_features={bad}"):
        RowParallelLinear(bad, H, group=group)
    with pytest.raises(ValueError, match=r"packed_splits\[1\]"):
        ColumnParallelLinear(H, 2 * tp + 1 + 2 * tp, group=group, packed_splits=[2 * tp, 1, 2 * tp])
    return 1


def _tp_checks(rank, tp):
    group = dist.group.WORLD
    dt = torch.float64
    return (
        _check_column(rank, tp, group, dt)
        + _check_row(rank, tp, group, dt)
        + _check_mlp_sp(rank, tp, group, dt)
        + _check_embedding(rank, tp, group, dt)
        + _check_cross_entropy(rank, tp, group)
        + _check_construction(rank, tp, group)
    )


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: 15-25 s, out of the fast subset
def test_tensor_parallel_layers(tp):
    counts = run_distributed(_tp_checks, tp)
    assert counts[0] > 50 and len(set(counts)) == 1, counts


def test_single_process_layers_match_torch():
    """Without a process group (tp=1) the layers and the loss are the plain torch ones."""
    assert not dist.is_initialized()
    torch.manual_seed(0)
    lin, emb = nn.Linear(H, OUT), nn.Embedding(V, H, padding_idx=0)
    x, ids = torch.randn(B, T, H), torch.randint(0, V, (B, T))
    col, row = ColumnParallelLinear.from_linear(lin), RowParallelLinear.from_linear(lin)
    pemb = VocabParallelEmbedding.from_embedding(emb)
    assert torch.equal(col(x), lin(x)) and torch.equal(row(x), lin(x)) and torch.equal(pemb(ids), emb(ids))
    logits, target = torch.randn(B, T, V, requires_grad=True), torch.randint(0, V, (B, T))
    target[0, 0] = -100
    ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(), label_smoothing=0.2)
    (g_ref,) = torch.autograd.grad(ref, logits)
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=0.2)
    (g,) = torch.autograd.grad(loss, logits)
    _close(loss, ref, "tp=1 CE")
    _close(g, g_ref, "tp=1 CE grad")
    with pytest.raises(ValueError, match="classes last"):
        vocab_parallel_cross_entropy(logits.transpose(1, 2), target)
