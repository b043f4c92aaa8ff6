"""The GRPO rollout's generation (hfpar.rollout.sampling: transformers' generate with each row's own Gumbel noise)
under TP=2 and EP=2 against one process, a representative subset of benchmarks/grpo/generation_sweep.py (every
causal-LM type): tokens identical and every step's logits within 1e-6, left-padded prompts, 2 gloo ranks.

    tp  qwen3_next (gated-DeltaNet convolution / recurrent states in the cache), jamba (Mamba states), gemma3_text
        (sliding-window layers), gpt2 (Conv1D, learned positions), falcon (inferred plan)
    ep  qwen3_moe, gpt_oss (attention sinks, sliding layers), each rank generating its own rows: the experts'
        all-to-all in every decoding step (synced_gpus)
"""

from __future__ import annotations

import pytest

from benchmarks.grpo.generation_sweep import ep_worker, tp_worker
from tests.helpers.dist import run_distributed

pytestmark = pytest.mark.slow

TP = ("qwen3_next", "jamba", "gemma3_text", "gpt2", "falcon")
EP = ("qwen3_moe", "gpt_oss")


@pytest.mark.parametrize("mode, worker, types", [("tp", tp_worker, TP), ("ep", ep_worker, EP)])
def test_generation_under_tp_and_ep_matches_one_process(mode, worker, types):
    res = run_distributed(worker, 2, list(types))[0]
    for mt in types:
        r = res[mt]
        assert r["status"] == "exact", (mode, mt, r)
        assert r["tokens_identical"] and r["worst_rel"] < 1e-6, (mode, mt, r)
