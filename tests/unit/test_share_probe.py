"""hfpar.data.share_probe: whether DPO's shared-prompt rows (a (B, 1, T, T) mask, packed pairs) give each sequence's
own log-probs, decided by running a tiny copy of the run's config (was: a list of nine family names).

- The probe's answer is the recipe's truth: for each family, the DPO log-probs of shared-prompt rows on a tiny model
  of the family equal those of the plain rows (each pair its own row, no custom mask) to 1e-10 exactly where the probe
  says yes, and differ where it says no (eager attention adds the boolean mask as a float; sliding windows and
  Mamba layers ignore or break the mask).
- The run decides: its attention (eager refused, sdpa shared), its config (Mistral with a window refused, without
  one shared), context and pipeline parallelism (never shared).
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoConfig

from hfpar.data.preference_collate import PairCollator, with_attention_mask
from hfpar.data.preference_tokenize import decode_targets
from hfpar.data.share_probe import KEYS, prompt_sharing_problem
from hfpar.parallel.context_parallel import shift_labels
from hfpar.parallel.tiny_copy import shrink, tiny_model
from hfpar.recipes.dpo import shares_prompt

SHARED = ["llama", "qwen3", "olmo2", "phi3", "glm4", "granite", "olmo", "gpt_neox", "cohere", "deepseek_v3", "gemma"]
NOT_SHARED = {  # model_type, attention: what a shared-prompt row would do
    ("llama", "eager"): "eager adds the boolean mask as a float",
    ("gemma2", "eager"): "sliding windows (and soft-capping)",
    ("cohere2", "sdpa"): "sliding windows",
    ("falcon_h1", "sdpa"): "Mamba layers carry state along the row",
}


def _dpo_logps(model, share: bool) -> torch.Tensor:
    """The (chosen, rejected) completion log-probs of four pairs, as DPOObjective sums them."""
    g = torch.Generator().manual_seed(1)
    lens = ((9, 6, 7), (3, 4, 2), (5, 2, 3), (4, 5, 5))
    pairs = [{k: torch.randint(3, 60, (n,), generator=g).tolist() for k, n in zip(KEYS, p)} for p in lens]
    collator = PairCollator(types.SimpleNamespace(pad_token_id=0), share_prompt=share)
    batch = shift_labels(with_attention_mask(collator(pairs)))
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}
    with torch.no_grad():
        lp = torch.log_softmax(model(**inputs, use_cache=False).logits, -1)
    token, seq, valid = decode_targets(batch["labels"])
    lp = lp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    return torch.zeros(2 * len(pairs), dtype=lp.dtype).index_add(0, seq[valid], lp[valid])


def _tiny(model_type: str, attn: str):
    cfg = shrink(AutoConfig.for_model(model_type), 4, keep=False)
    return cfg, tiny_model(cfg, attn)


@pytest.mark.parametrize("model_type", SHARED)
def test_families_that_take_the_mask_share_and_give_the_plain_log_probs(model_type):
    cfg, model = _tiny(model_type, "sdpa")
    assert prompt_sharing_problem(cfg, "sdpa") is None
    torch.testing.assert_close(_dpo_logps(model, True), _dpo_logps(model, False), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("model_type", "attn"), sorted(NOT_SHARED))
def test_refused_where_shared_rows_would_train_something_else(model_type, attn):
    cfg, model = _tiny(model_type, attn)
    why = prompt_sharing_problem(cfg, attn)
    assert why is not None and "\n" not in why, NOT_SHARED[model_type, attn]
    # the refusal is real: shared rows would give other log-probs than the plain rows
    assert not torch.allclose(_dpo_logps(model, True), _dpo_logps(model, False), rtol=1e-6, atol=1e-6)


def test_the_run_decides():
    windowed = AutoConfig.for_model("mistral", sliding_window=4096)
    plain = AutoConfig.for_model("mistral", sliding_window=None)
    assert "differ from the sequence alone" in prompt_sharing_problem(windowed)
    assert prompt_sharing_problem(plain) is None
    assert "not checked on CPU" in prompt_sharing_problem(plain, "flash_attention_2")
    args = types.SimpleNamespace(attn_implementation=None)
    for cp, pp, want in ((1, 1, True), (2, 1, False), (1, 2, False)):
        assert shares_prompt(args, types.SimpleNamespace(cp=cp, pp=pp), plain) is want
    assert shares_prompt(args, types.SimpleNamespace(cp=1, pp=1), None) is False
