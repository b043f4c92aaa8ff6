"""The chunked LM head + cross-entropy (hfpar.parallel.chunked_loss) against the model's own logits and F.cross_entropy.

    python -m pytest -q -p no:cacheprovider tests/distributed/test_chunked_loss.py

- the function: loss and gradients (input, weight, bias) of chunked_linear_cross_entropy equal F.linear +
  F.cross_entropy(reduction="sum") in fp32 (1e-6 relative) for chunk sizes that do and do not divide the tokens,
  with ignored targets; under bf16 autocast within the measured bf16 noise of the unchunked path;
- where it is on by default (decided by chunked_loss.logits_problem on a tiny copy of the model's config, not by a
  list of names: the tests' 14 families and others no list named, GLM-4, OLMo, Phi, GPT-NeoX, DeepSeek-V3, Granite
  with unscaled logits): one forward + backward through the patched head equals the model's logits ->
  shifted_lm_loss_sum in loss and every parameter gradient (fp32, 1e-6), and without targets the head returns the
  model's logits unchanged; where logits are soft-capped (Gemma 2) or scaled (Cohere, Granite's logits_scaling) after
  the head, the chunked loss would differ, which is why the check exists;
- tensor parallelism (2 gloo ranks): the vocab-parallel head, with and without sequence parallelism, gives the
  unsharded model's loss and gradients;
- the recipe: the default (chunked) run equals --loss_chunk_size 0 per step, and explicit chunking of a model the
  check refuses is refused before the model loads.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.tensor_parallel.family_sweep import tiny_config
from hfpar.config import ConfigError, parse_args
from hfpar.context import ParallelContext
from hfpar.parallel.chunked_loss import (
    ChunkedLoss,
    chunkable,
    chunked_linear_cross_entropy,
    install_chunked_loss,
    logits_problem,
)
from hfpar.parallel.context_parallel import shift_labels
from hfpar.preflight import model_problems
from hfpar.train.losses import make_loss_fn, shifted_lm_loss_sum
from tests.helpers.dist import run_distributed
from tests.helpers.launch import rel_close
from tests.helpers.tiny_configs import CONFIGS

IGNORE = -100


def _case(n=37, h=16, v=50, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=dtype)
    w = torch.randn(v, h, generator=g, dtype=dtype) * 0.3
    b = torch.randn(v, generator=g, dtype=dtype) * 0.1
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = IGNORE
    return x, w, b, t


def _grads(fn, *tensors):
    leaves = [x.clone().requires_grad_() for x in tensors]
    loss = fn(*leaves)
    loss.backward()
    return loss.detach(), [x.grad for x in leaves]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
def test_chunked_linear_cross_entropy_is_exact_in_fp32(chunk):
    x, w, b, t = _case()
    ref, ref_g = _grads(
        lambda x, w, b: F.cross_entropy(F.linear(x, w, b), t, ignore_index=IGNORE, reduction="sum"), x, w, b
    )
    got, got_g = _grads(lambda x, w, b: chunked_linear_cross_entropy(x, w, b, t, chunk=chunk), x, w, b)
    assert rel_close(float(got), float(ref), 1e-6)
    for a, r in zip(got_g, ref_g):
        assert _rel(a, r) < 1e-6
    # the upstream gradient scales the result (the trainer back-propagates loss_sum * scale)
    _, scaled = _grads(lambda x, w, b: 0.25 * chunked_linear_cross_entropy(x, w, b, t, chunk=chunk), x, w, b)
    assert _rel(scaled[0], 0.25 * ref_g[0]) < 1e-6


def test_no_grad_and_all_ignored():
    x, w, b, t = _case()
    with torch.no_grad():
        got = chunked_linear_cross_entropy(x, w, b, t, chunk=8)
    assert rel_close(float(got), float(F.cross_entropy(F.linear(x, w, b), t, reduction="sum")), 1e-6)
    t_none = torch.full_like(t, IGNORE)
    _, g = _grads(lambda x, w: chunked_linear_cross_entropy(x, w, None, t_none, chunk=8), x, w)
    assert float(g[0].abs().max()) == 0.0 and float(g[1].abs().max()) == 0.0


def test_bf16_autocast_within_the_unchunked_noise():
    """Both paths in bf16 autocast against the fp32 truth: the chunked error is not larger than 2x the unchunked."""
    x, w, b, t = _case(n=256, h=64, v=512)
    ref, ref_g = _grads(lambda x, w, b: F.cross_entropy(F.linear(x, w, b), t, reduction="sum"), x, w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unch, unch_g = _grads(lambda x, w, b: F.cross_entropy(F.linear(x, w, b).float(), t, reduction="sum"), x, w, b)
        got, got_g = _grads(lambda x, w, b: chunked_linear_cross_entropy(x, w, b, t, chunk=48), x, w, b)
    assert got.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got_g)
    err_unch = abs(float(unch) - float(ref)) / float(ref)
    assert abs(float(got) - float(ref)) / float(ref) <= max(2 * err_unch, 1e-3)
    for a, u, r in zip(got_g, unch_g, ref_g):
        assert _rel(a, r) <= max(2 * _rel(u, r), 1e-2)


# ------------------------------------------------------------------------------------------ model families
OTHERS = ("glm4", "olmo", "phi", "gpt_neox", "deepseek_v3", "granite")  # no list of hfpar's names them
SCALED = {"gemma2": {}, "cohere": {}, "granite": {"logits_scaling": 4.0}}  # logits changed after the head


def _tiny(model_type: str, **over):
    cfg = (
        AutoConfig.for_model(model_type, **CONFIGS[model_type][0]) if model_type in CONFIGS else tiny_config(model_type)
    )
    for k, v in over.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    return model.eval()  # no dropout (GPT-2): the two paths see the same function


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :3] = IGNORE
    return shift_labels({"input_ids": ids, "labels": labels})


def _loss_and_grads(model, batch, loss_fn):
    model.zero_grad(set_to_none=True)
    scope = getattr(loss_fn, "scope", None)
    with scope(batch["labels"]) if scope else torch.enable_grad():
        out = model(input_ids=batch["input_ids"], use_cache=False).logits
    loss, _ = loss_fn(out, batch["labels"])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", [m for m in CONFIGS if m not in SCALED] + list(OTHERS))
def test_family_loss_and_grads_equal_the_models_own(model_type):
    ref_model = _tiny(model_type)
    assert chunkable(ref_model) is None  # on by default
    model = copy.deepcopy(ref_model)
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        logits = ref_model(input_ids=batch["input_ids"], use_cache=False).logits
    state = install_chunked_loss(model, chunk=7)
    with torch.no_grad():  # no targets: the head is the model's own
        assert torch.equal(model(input_ids=batch["input_ids"], use_cache=False).logits, logits)
    ref, ref_g = _loss_and_grads(ref_model, batch, shifted_lm_loss_sum)
    loss_fn = make_loss_fn("lm", model)
    assert loss_fn.scope == state.targets
    got, got_g = _loss_and_grads(model, batch, loss_fn)
    assert rel_close(got, ref, 1e-6), (got, ref)
    assert set(got_g) == set(ref_g)
    worst = max(_rel(got_g[n], ref_g[n]) for n in ref_g if float(ref_g[n].norm()) > 0)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("model_type", sorted(SCALED))
def test_logits_changed_after_the_head_are_not_chunked(model_type):
    """Gemma 2 soft-caps its logits after the head, Cohere and Granite scale them: chunking the head would change the
    loss, so the check refuses them (Granite by its config: logits_scaling 1 is chunked above)."""
    model = _tiny(model_type, **SCALED[model_type])
    why = chunkable(model)
    assert why and "its logits are not its LM head's output" in why and "\n" not in why, why
    assert logits_problem(model.config) in why
    batch = _batch(model.config.vocab_size)
    ref, _ = _loss_and_grads(model, batch, shifted_lm_loss_sum)
    head = model.get_output_embeddings()
    state = ChunkedLoss(head, 7)
    head.forward = state.forward
    with state.targets(batch["labels"]):
        got = float(model(input_ids=batch["input_ids"], use_cache=False).logits.reshape(()))
    assert not rel_close(got, ref, 1e-3)


# ------------------------------------------------------------------------------------------ tensor parallel
def _tp_worker(rank, world, sp):
    from hfpar.parallel.tensor_parallel import apply_tensor_parallel

    cfg = AutoConfig.for_model("llama", **CONFIGS["llama"][0])
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = copy.deepcopy(ref)
    apply_tensor_parallel(model, sequence_parallel=sp)
    state = install_chunked_loss(model, chunk=5)
    assert state.group is not None
    batch = _batch(cfg.vocab_size)
    ref_loss, ref_g = _loss_and_grads(ref, batch, shifted_lm_loss_sum)
    loss, g = _loss_and_grads(model, batch, make_loss_fn("lm", model))
    head = model.get_output_embeddings()
    from hfpar.parallel.comm import all_gather

    full_head = all_gather(head.weight.grad, dim=0)
    norm = model.model.norm.weight.grad  # complete: apply_tensor_parallel sums the sequence-parallel partial grads
    return {
        "loss": abs(loss - ref_loss) / ref_loss,
        "head": _rel(full_head, ref_g["lm_head.weight"]),
        "norm": _rel(norm, ref_g["model.norm.weight"]),
    }


@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_head_equals_the_unsharded_model(sp):
    for r in run_distributed(_tp_worker, 2, sp):
        assert max(r.values()) < 1e-5, r


def test_explicit_chunking_is_refused_before_the_model_loads(tmp_path):
    """A config directory without weights: the preflight names the family and the valid choices in one line."""
    AutoConfig.for_model("gemma2", **CONFIGS["gemma2"][0]).save_pretrained(tmp_path)
    for argv, refused in [(["--loss_chunk_size", "256"], True), ([], False), (["--loss_chunk_size", "0"], False)]:
        args = parse_args(["--model_name_or_path", str(tmp_path), *argv], recipe="sft")
        lines = [p for p in model_problems(args, ParallelContext(world=1), "lm") if p.startswith("--loss_chunk_size")]
        assert len(lines) == int(refused), lines
        assert not refused or ("'gemma2'" in lines[0] and "LM head's output" in lines[0] and "\n" not in lines[0])
    with pytest.raises(ConfigError, match="--loss_chunk_size -1: must be >= 1 token"):
        parse_args(["--loss_chunk_size", "-1"], recipe="sft")
