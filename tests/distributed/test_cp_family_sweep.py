"""A subset of the context-parallel family sweep (benchmarks/context_parallel/family_sweep.py runs every causal-LM
type): a tiny float64 model of each, cp = 2 ring and Ulysses through transformers' attention registry against the
unsharded model with its stock attention (logits and every gradient within 1e-6), on 2 gloo ranks (one spawn), the
preflight's three checks deciding first. Families this round opened or closed:

    gpt_oss, granite_swa, mimo_v2_flash   attention sinks (s_aux) in the ring, Ulysses and the blockwise kernels
    gpt2, dbrx, jetmoe, deepseek_v2,      probed on their tiny copy (their forward reads values the meta device
    hunyuan_v1_dense                      lacks, or their default config runs only once shrunk: MLA + MoE top-k groups)
    opt, ctrl                             key-bias gradients zero in exact arithmetic (the check's 1e-6 floor)
    llama4_text                           chunked attention, a temperature from the index in the row (was refused by
                                          the cut-rows check: now exact, temperature.py, RowLayout.chunked)
    doge                                  refused by the cut-rows check (a learned dynamic mask), confirmed: the real
                                          cp run differs
    deepseek_v4                           refused by the probe: compressed keys beside the row's own
    lfm3                                  short-convolution layers run on the whole rows on every cp rank
                                          (context_parallel/gathered.py; was refused by the mixing check; the sweep
                                          holds the gated-DeltaNet and Mamba families: their torch kernels cost minutes)
"""

from __future__ import annotations

import pytest

from benchmarks.context_parallel.family_sweep import sweep_worker
from tests.helpers.dist import run_distributed

pytestmark = pytest.mark.slow

EXACT = (
    "gpt_oss",
    "granite_swa",
    "mimo_v2_flash",
    "gpt2",
    "dbrx",
    "jetmoe",
    "deepseek_v2",
    "hunyuan_v1_dense",
    "opt",
    "ctrl",
    "llama4_text",
)
GATHERED = {"lfm3": ["Lfm3ShortConv"]}
CUT_ROWS = {"doge": "self_attn.A differs"}


@pytest.fixture(scope="module")
def results():
    return run_distributed(sweep_worker, 2, [*EXACT, *GATHERED, *CUT_ROWS, "deepseek_v4"], timeout=900)[0]


@pytest.mark.parametrize("model_type", EXACT)
def test_exact_under_ring_and_ulysses(results, model_type):
    r = results[model_type]
    assert r["status"] == "exact" and r["ring"]["worst_rel"] < 1e-6 and r["ulysses"]["worst_rel"] < 1e-6, r


@pytest.mark.parametrize("model_type", sorted(GATHERED))
def test_mixers_on_whole_rows_exact_under_ring_and_ulysses(results, model_type):
    r = results[model_type]
    assert r["status"] == "exact" and r["gathered"] == GATHERED[model_type], r
    assert r["ring"]["worst_rel"] < 1e-6 and r["ulysses"]["worst_rel"] < 1e-6, r


@pytest.mark.parametrize("model_type", sorted(CUT_ROWS))
def test_cut_rows_refusal_confirmed_by_real_ranks(results, model_type):
    r = results[model_type]
    assert r["status"] == "refused" and CUT_ROWS[model_type] in r["why"] and "\n" not in r["why"], r
    assert r["refusal_confirmed"], r  # the real cp run does differ: the refusal is no false alarm


def test_compressed_keys_refused(results):
    r = results["deepseek_v4"]
    assert r["status"] == "refused" and "keys of its own making" in r["why"], r
