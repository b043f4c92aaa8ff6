"""Multimodal wrappers whose language model is nested (`config.text_config`, a `language_model` submodule) under
tensor, context and pipeline parallelism, on 2 gloo ranks (one spawn), float32, text-only batches:

    TP=2   gemma3, gemma4, gemma4_unified, fuyu, moss_transcribe_diarize (what AutoModelForCausalLM returns: the
           held-out sweep's five AttributeErrors, issue 42) and llava, mistral3, smolvlm (AutoModelForImageTextToText):
           loss and every gradient equal to one process within 1e-4, twice (one SGD step between), the language
           model's blocks sharded, the vision / audio tower replicated (no TP layer outside the language model)
    SP     gemma3 with sequence parallelism: exact too
    EP=2   aria (AriaForConditionalGeneration: an MoE language model under the wrapper): each rank's loss with the
           router's aux loss and every gradient after the data-parallel reduction equal to one process, twice
    CP=2   llava, ring: logits at this rank's positions and the gradients (summed over cp) equal to one process;
           the language model's attention is hfpar's, the vision tower keeps its own
    load   fuyu saved, then loaded on a meta skeleton with TP=2 (each rank reads only its slices, the inferred plan
           verified on a random probe): every tensor equal to from_pretrained + the same TP
    PP     refused in one line naming the model type and what is valid (a wrapper's forward runs its towers and its
           language model in one call)
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from benchmarks.moe import ep_family_sweep as ep_sweep
from hfpar.parallel.context_parallel import cp_rows, enable_cp_attention, shard_batch, shift_labels
from hfpar.parallel.context_parallel.attention import NAME as CP_ATTENTION
from hfpar.parallel.expert_parallel import apply_expert_parallel, expert_parallel_groups
from hfpar.parallel.language_model import language_model_path
from hfpar.parallel.pipeline import balanced_split
from hfpar.parallel.sharding import shard_spec
from hfpar.parallel.tensor_parallel import apply_tensor_parallel
from tests.distributed.test_loading import _same_as_full_load
from tests.helpers.dist import run_distributed
from tests.helpers.vlm_models import CAUSAL, IMAGE_TEXT, build_vlm, sharded_modules, text_batch, tp_step_diff

pytestmark = pytest.mark.slow

TOL = 1e-4  # float32 (the parity contract's)


def _tp(model_type: str, sequence_parallel: bool = False) -> dict:
    model = build_vlm(model_type)
    ref = copy.deepcopy(model)
    try:
        apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sequence_parallel)
    except ValueError as exc:
        return {"refused": str(exc)}
    ids = text_batch(model.get_input_embeddings().num_embeddings)
    worst = max(tp_step_diff(model, ref, ids), tp_step_diff(model, ref, ids))
    lm = language_model_path(model)
    head = {n for n, m in model.named_modules() if m is model.get_output_embeddings()}
    outside = [n for n in sharded_modules(model, "") if not n.startswith(lm + ".") and n not in head]
    return {"worst": worst, "lm": lm, "lm_sharded": len(sharded_modules(model, lm + ".")), "outside": outside}


def _cp(model_type: str, rank: int, world: int) -> dict:
    ref = build_vlm(model_type, attn="sdpa")
    model = copy.deepcopy(ref)
    ids = text_batch(ref.get_input_embeddings().num_embeddings, seed=3).repeat(1, 2)  # (2, 16)
    w = torch.randn(*ids.shape, ref.get_output_embeddings().out_features, generator=torch.Generator().manual_seed(2))
    logits = ref(input_ids=ids).logits
    (logits * w).sum().backward()
    enable_cp_attention(model)
    local, rows = shard_batch(shift_labels({"input_ids": ids, "labels": ids}), rank, world)
    with cp_rows(rows, dist.group.WORLD, "ring"):
        got = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        (got * w[:, rows.local]).sum().backward()
    worst = (got.detach() - logits.detach()[:, rows.local]).abs().max().item() / logits.abs().max().item()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            g = p.grad.clone()
            dist.all_reduce(g)  # each cp rank: its tokens' part
            worst = max(worst, ((g - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item())
    tower = model.config.vision_config._attn_implementation
    return {"worst": worst, "text_attn": model.config.get_text_config()._attn_implementation, "tower_attn": tower}


def _ep(rank: int, world: int) -> dict:
    model = build_vlm("aria")
    text = model.config.get_text_config()
    if hasattr(text, "output_router_logits"):
        text.output_router_logits = model.config.output_router_logits = True
    ref = copy.deepcopy(model)
    ids, labels = ep_sweep.batch(model.get_input_embeddings().num_embeddings, seed=1 + rank)  # rows by dp rank
    ep_group, edp_group = expert_parallel_groups(world)
    apply_expert_parallel(model, ep_group, edp_group=edp_group)
    experts = [n for n, p in model.named_parameters() if shard_spec(p) is not None and shard_spec(p).kind == "ep"]
    worst = max(ep_sweep._step_compare(model, ref, ids, labels), ep_sweep._step_compare(model, ref, ids, labels))
    return {"worst": worst, "experts": experts, "lm": language_model_path(model)}


def _pp(model_type: str) -> str:
    try:
        balanced_split(build_vlm(model_type), 2)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def _all(rank: int, world: int, saved: str) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out_load = _same_as_full_load(rank, world, {"fuyu": (saved, "tp")})
    out = {"tp": {mt: _tp(mt) for mt in CAUSAL + IMAGE_TEXT}}
    out["sp"] = _tp("gemma3", sequence_parallel=True)
    out["ep"] = _ep(rank, world)
    out["cp"] = _cp("llava", rank, world)
    out["pp"] = _pp("gemma3")
    out["load"] = out_load
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    saved = tmp_path_factory.mktemp("vlm") / "fuyu"
    build_vlm("fuyu").save_pretrained(saved)
    return run_distributed(_all, 2, str(saved), timeout=900)[0]


@pytest.mark.parametrize("model_type", CAUSAL + IMAGE_TEXT)
def test_tensor_parallel_exact_on_the_language_model(results, model_type):
    r = results["tp"][model_type]
    assert "refused" not in r, r
    assert r["worst"][0] < TOL, r
    assert r["lm"] and r["lm_sharded"] > 0 and r["outside"] == [], r  # towers replicated, the LM's blocks sharded


def test_sequence_parallel_exact_on_a_wrapper(results):
    r = results["sp"]
    assert "refused" not in r and r["worst"][0] < TOL and r["lm_sharded"] > 0, r


def test_context_parallel_exact_and_the_tower_keeps_its_attention(results):
    r = results["cp"]
    assert r["worst"] < TOL, r
    assert r["text_attn"] == CP_ATTENTION and r["tower_attn"] != CP_ATTENTION, r


def test_expert_parallel_exact_on_a_wrapped_moe_language_model(results):
    r = results["ep"]
    assert r["worst"][0] < TOL, r
    assert r["experts"] and all(n.startswith(r["lm"] + ".") for n in r["experts"]), r


def test_sharded_loading_of_a_wrapper_equals_full_load_then_shard(results):
    worst, read, total = results["load"]["fuyu"]
    assert worst == 0.0 and read < total, results["load"]


def test_pipeline_refused_in_one_line(results):
    why = results["pp"]
    assert "\n" not in why and "model_type 'gemma3' (Gemma3ForConditionalGeneration)" in why, why
    assert "valid: pp_size 1" in why, why
