"""Plans derived from HF's config.base_model_tp_plan (hfpar.parallel.tensor_parallel.derived) and GPT-2's Conv1D plan.

    python -m pytest tests/distributed/test_tp_derived_plans.py -q

In this process (no process group): the mapping itself (Llama's derived plan == the TP entries of hfpar's
written one), and the one-line refusals. On 2 gloo ranks (one spawn), in float64 against the unsharded model:
every gradient (shards gathered), the global grad norm, per-rank head counts, and the gathered state dict ->
save_pretrained -> from_pretrained round trip (GPT-2's Conv1D weights keep their (in, out) layout).
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hfpar.parallel.sharding import shard_spec
from tests.helpers.dist import run_distributed
from tests.helpers.tp_models import DERIVED, MOE_TINY, batch, build, rel

CASES = [(mt, False) for mt in DERIVED] + [("gpt2", False), ("gpt2", True)]
TOL = 1e-10  # float64
# OLMo-2's q/k norms run in float32 even in a float64 model (its own RMSNorm casts); sharded, their sum of squares is
# added in another order (norms.py), so they agree to fp32 rounding, not to fp64's. MiniCPM3 likewise: its latent
# kv_a_layernorm (float32) is back-propagated per rank's heads and the partial gradients summed after it.
FAMILY_TOL = {"olmo2": 1e-6, "minicpm3": 1e-6}


def _derive(model_type: str, **overrides):
    from hfpar.parallel.tensor_parallel import derive_plan

    return derive_plan(build(model_type, **overrides))


def test_llama_derived_plan_equals_the_written_tp_entries():
    from hfpar.parallel.tensor_parallel import get_plan

    written = {k: v for k, v in get_plan("llama").items() if v not in ("sequence_scatter", "replicated_sp")}
    assert _derive("llama") == written


def test_derived_styles():
    plan = _derive("qwen3")  # per-head q/k norms
    assert plan["model.layers.*.self_attn.q_norm"] == "replicated_heads"
    plan = _derive("starcoder2")  # c_fc / c_proj MLP
    assert plan["model.layers.*.mlp"] == "mlp" and plan["model.layers.*.mlp.c_fc"] == "colwise"
    assert plan["model.layers.*.self_attn"] == "attention" and plan["model.embed_tokens"] == "vocab_embedding"
    assert _derive("phi")["model.layers.*.self_attn.dense"] == "rowwise"


@pytest.mark.parametrize(
    "model_type, entry, style",
    [
        # qwen4_exp's real entry (an n-gram embedding split by columns), in a tiny granite's plan: building a tiny
        # qwen4_exp costs seconds (inkling_text's all_reduce, formerly here, is mapped now: the region sums)
        ("granite", "layers.*.ple.ple_embedding.ngram_embedding", "embedding_colwise"),
    ],
)
def test_unmappable_entry_is_refused_in_one_line(model_type, entry, style):
    from hfpar.parallel.tensor_parallel import (
        apply_tensor_parallel,
        derived_plan_problem,
    )

    model = build(model_type)
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, entry: style}
    with (
        mock.patch.object(dist, "is_initialized", return_value=True),
        mock.patch.object(dist, "get_world_size", return_value=2),
        pytest.raises(ValueError) as e,
    ):
        apply_tensor_parallel(model)  # refused before any collective
    msg = str(e.value)
    assert "\n" not in msg and f"model_type {model_type!r}" in msg and f"{entry!r}: {style!r}" in msg, msg
    assert derived_plan_problem(model.config) == msg
    assert not any(shard_spec(p) is not None for p in model.parameters())


def test_head_spanning_norms_latent_and_linear_attention():
    plan = _derive("olmo2")  # colwise_gather_output: heads stay sharded
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.*.self_attn.q_norm"] == plan["model.layers.*.self_attn.k_norm"] == "sharded_rmsnorm"
    assert _derive("glm4")["model.layers.*.mlp.gate_up_proj"] == "colwise_packed:gate_up"
    plan = _derive("minicpm3")  # MLA: latent down-projections replicated
    assert (
        plan["model.layers.*.self_attn.kv_a_proj_with_mqa"]
        == plan["model.layers.*.self_attn.q_a_proj"]
        == "replicated_heads"
        and plan["model.layers.*.self_attn.kv_b_proj"] == "colwise"
    )


def test_attention_lists_replicate_entries_and_width_attributes():
    """LongCat-Flash's two attentions per layer (`layers.*.self_attn.*`: a region inside a list inside the layer,
    not the layer), Inkling-2's `replicate` entry (kept whole), DBRX's fused qkv split by the module's `hidden_size`
    (localized with the heads); a region that IS the decoder layer stays refused."""
    from benchmarks.tensor_parallel.family_sweep import build as sweep_build
    from hfpar.parallel.tensor_parallel import derive_plan
    from hfpar.parallel.tensor_parallel.heads import localize_heads

    longcat = sweep_build("longcat_flash")
    plan = derive_plan(longcat)
    assert plan["model.layers.*.self_attn.*"] == "attention" and plan["model.layers.*.mlps.*"] == "mlp", plan
    assert plan["model.layers.*.self_attn.*.q_b_proj"] == "colwise"
    with pytest.raises(ValueError, match="sit directly in 'model.layers.\\*'"):
        derive_plan(longcat, {"layers.*.q_proj": "colwise", "layers.*.o_proj": "rowwise"})
    inkling = sweep_build("inkling2_text")
    assert inkling.config.base_model_tp_plan["embed_tokens"] == "replicate"
    assert derive_plan(inkling) == {"lm_head": "colwise_lm_head"}  # mapped to nothing, not refused (experts: EP)
    attn = sweep_build("dbrx").transformer.blocks[0].norm_attn_norm.attn
    localize_heads(attn, None, 2)  # an `attention` region: the heads only (CodeGen's forward needs embed_dim whole)
    assert (attn.num_heads, attn.num_key_value_heads, attn.hidden_size, attn.head_dim) == (2, 1, 64, 16)
    attn = sweep_build("dbrx").transformer.blocks[0].norm_attn_norm.attn
    localize_heads(attn, None, 2, widths=True)  # `attention_widths` (a candidate the block check verifies)
    assert (attn.num_heads, attn.num_key_value_heads, attn.hidden_size, attn.head_dim) == (2, 1, 32, 16)
    attn = build("llama").model.layers[0].self_attn
    width = {k: v for k, v in vars(attn).items() if isinstance(v, int)}
    localize_heads(attn, None, 1, widths=True)  # Llama's attention holds no all-heads width: nothing moves
    assert {k: v for k, v in vars(attn).items() if isinstance(v, int)} == width


def test_moe_experts_are_left_out_and_missing_plan_is_refused():
    from transformers import AutoConfig

    from hfpar.parallel.tensor_parallel import derived_plan_problem

    assert derived_plan_problem(AutoConfig.for_model("mixtral")) is None  # attention only: experts left to EP
    plan = _derive("mixtral")
    assert plan["model.layers.*.self_attn"] == "attention" and not any("experts" in k for k in plan), plan
    assert "model.layers.*.mlp" not in plan
    assert derived_plan_problem(AutoConfig.for_model("bitnet")) is None  # no base_model_tp_plan: inferred at apply
    assert derived_plan_problem(AutoConfig.for_model("granite")) is None


def test_sequence_parallel_refused_with_moe_blocks_before_any_collective():
    from hfpar.parallel.tensor_parallel import apply_tensor_parallel

    with (
        mock.patch.object(dist, "is_initialized", return_value=True),
        mock.patch.object(dist, "get_world_size", return_value=2),
        pytest.raises(ValueError, match=r"sequence_parallel with MoE blocks \(model.layers.0.mlp, ...\)"),
    ):
        apply_tensor_parallel(build("mixtral"), sequence_parallel=True)


# ----------------------------------------------------------------------------- 2 ranks
def _full_grads(model) -> dict:
    from hfpar.parallel.tensor_parallel import gather_shards

    out = {}
    for n, p in model.named_parameters():
        s = shard_spec(p)
        sharded = s is not None and s.kind == "tp" and s.sharded
        out[n] = gather_shards(p.grad, s.dim, s.group, s.packed_splits) if sharded else p.grad
    return out


def _case(rank: int, case, outdir: str) -> dict:
    from transformers import AutoModelForCausalLM

    from hfpar.parallel.tensor_parallel import (
        apply_tensor_parallel,
        gather_full_state_dict,
        sync_sequence_parallel_grads,
        tp_grad_norm,
    )

    mt, sp = case
    model = build(mt).double()
    ref = copy.deepcopy(model)
    ids, mask, labels = batch()
    ref_logits = ref(input_ids=ids, attention_mask=mask).logits  # (B, T, V) float64
    F.cross_entropy(ref_logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).backward()  # (HF's loss: fp32)
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sp)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    sync_sequence_parallel_grads(model)
    got, want = _full_grads(model), {n: p.grad for n, p in ref.named_parameters()}
    res = {
        "names": sorted(got) == sorted(want),
        "grad_worst": max((rel(got[n], want[n]), n) for n in want),
        "norm_rel": rel(tp_grad_norm(model.parameters()), torch.nn.utils.get_total_norm(list(want.values()))),
        "sharded": sorted(
            n for n, p in model.named_parameters() if shard_spec(p) is not None and shard_spec(p).kind == "tp"
        ),
        "heads": sorted(
            {m.config.num_attention_heads for n, m in model.named_modules() if n.endswith(("self_attn", ".attn"))}
        ),
    }  # as each attention sees it
    head = shard_spec(model.get_output_embeddings().weight)  # tied or not
    res["head_vocab_parallel"] = head is not None and head.sharded and head.dim == 0
    sd, ref_sd = gather_full_state_dict(model), ref.state_dict()
    res["sd"] = sorted(sd) == sorted(ref_sd) and all(sd[k].shape == ref_sd[k].shape for k in ref_sd)
    res["sd_max_abs"] = max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
    if rank == 0 and not sp:
        path = f"{outdir}/{mt}"
        model.save_pretrained(path, state_dict=sd)
        kw = {"experts_implementation": "eager"} if mt in MOE_TINY else {}  # HF's grouped_mm has no fp64
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **kw).eval()
        with torch.no_grad():
            res["export_rel"] = rel(
                loaded(input_ids=ids, attention_mask=mask).logits, ref.eval()(input_ids=ids, attention_mask=mask).logits
            )
    dist.barrier()
    return res


def _worker(rank: int, world_size: int, outdir: str) -> dict:
    torch.set_num_threads(1)
    return {c: _case(rank, c, outdir) for c in CASES}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("tp_derived")), timeout=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'sp' if c[1] else 'tp'}")
def test_gradients_and_export_match_unsharded(ranks, case):
    for rank, res in enumerate(ranks):
        r = res[case]
        tol = FAMILY_TOL.get(case[0], TOL)
        assert r["names"] and r["grad_worst"][0] < tol, (rank, r["grad_worst"])
        assert r["norm_rel"] < tol, r["norm_rel"]
        assert r["sd"] and r["sd_max_abs"] == 0.0, r["sd_max_abs"]
        assert r["heads"] == [2], r["heads"]  # 4 heads / tp 2
        proj = {
            "gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "wte"),
            "phi": ("self_attn.dense", "fc2"),
            "starcoder2": ("mlp.c_fc", "mlp.c_proj"),
            "mixtral": ("o_proj",),
            "qwen3_moe": ("o_proj",),
            "qwen2_moe": ("o_proj", "layers.1.mlp.down_proj"),
        }.get(case[0], ("o_proj", "down_proj"))
        assert all(any(p in n for n in r["sharded"]) for p in proj), r["sharded"]
        # MoE blocks (router, experts, shared expert) stay whole on every TP rank: expert parallelism splits them
        moe_layers = {"mixtral": (0, 1), "qwen3_moe": (0, 1), "qwen2_moe": (0,)}.get(case[0], ())
        assert not [n for n in r["sharded"] for i in moe_layers if f"layers.{i}.mlp." in n], r["sharded"]
        assert r["head_vocab_parallel"]
    if not case[1]:
        assert ranks[0][case]["export_rel"] < FAMILY_TOL.get(case[0], 1e-10), ranks[0][case]["export_rel"]


def test_untested_derived_family_warns():
    """A derived family not parity-tested here says so (then it stops on the odd vocab, before any collective)."""
    from hfpar.parallel.tensor_parallel import apply_tensor_parallel

    with (
        mock.patch.object(dist, "is_initialized", return_value=True),
        mock.patch.object(dist, "get_world_size", return_value=2),
        pytest.warns(UserWarning, match=r"'helium' .*not parity-tested"),
        pytest.raises(ValueError, match=r"vocab_size 129 is not divisible by tp_size 2"),
    ):
        apply_tensor_parallel(build("helium", vocab_size=129))
