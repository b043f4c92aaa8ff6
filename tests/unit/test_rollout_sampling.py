"""Rollout sampling is a function of (seed, step, prompt, generation index) and the weights, not of the batching:
the same rows sampled alone, in another order, in another batch with other padding give the same tokens; and the
Gumbel-max draw follows softmax(warped logits).

    python -m pytest -q tests/unit/test_rollout_sampling.py
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hfpar.rollout.sampling import RowGumbelNoise, completion_mask, row_key, sample, warpers


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


def _left_pad(prompts: list[list[int]]):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    return ids, (ids != 0).long()


def _completions(model, prompts, keys, **kw):
    ids, mask = _left_pad(prompts)
    out = sample(model, ids, mask, keys, max_new_tokens=8, eos_token_id=1, pad_token_id=0, **kw)[:, ids.size(1) :]
    keep = completion_mask(out, eos_token_id=1)
    return [row[m.bool()].tolist() for row, m in zip(out, keep)]  # a row's tokens up to its EOS


def test_a_row_samples_the_same_tokens_whatever_it_is_batched_with():
    model = _model()
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14, 15], [5, 6, 7]]
    keys = [row_key(42, 3, p, g) for p, g in [(0, 0), (1, 0), (2, 0), (0, 1)]]
    together = _completions(model, prompts, keys, temperature=0.9, top_k=20, top_p=0.95)
    alone = [_completions(model, [p], [k], temperature=0.9, top_k=20, top_p=0.95)[0] for p, k in zip(prompts, keys)]
    reordered = _completions(model, prompts[::-1], keys[::-1], temperature=0.9, top_k=20, top_p=0.95)[::-1]
    assert together == alone == reordered
    assert together[0] != together[3]  # two generations of one prompt differ (different keys)
    assert _completions(model, prompts, [row_key(42, 4, 0, 0), *keys[1:]], temperature=0.9)[0] != together[0]


def test_gumbel_max_draws_follow_the_warped_distribution():
    torch.manual_seed(1)
    logits = torch.randn(1, 6)
    warped = logits.clone()
    for w in warpers(0.7, 4, 0.9):
        warped = w(None, warped)
    want = torch.softmax(warped, -1)[0]
    n = 6000
    noise = RowGumbelNoise([row_key(0, 0, 0, i) for i in range(n)], torch.device("cpu"))
    picks = noise(None, warped.expand(n, -1)).argmax(-1)
    freq = torch.bincount(picks, minlength=6).double() / n
    assert torch.all(want[freq > 0] > 0)  # never a token top-k / top-p removed
    assert torch.allclose(freq, want.double(), atol=0.02), (freq, want)


def test_row_keys_are_stable_and_distinct():
    assert row_key(1, 2, 3, 4) == row_key(1, 2, 3, 4)
    assert len({row_key(1, s, p, g) for s in range(4) for p in range(8) for g in range(8)}) == 256


def test_completion_mask_keeps_up_to_the_first_eos():
    ids = torch.tensor([[4, 1, 0, 0], [4, 5, 6, 7], [1, 1, 0, 0]])
    assert completion_mask(ids, 1).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_min_new_tokens_keeps_eos_out_until_then_and_rows_their_own():
    """--generation_kwargs '{"min_new_tokens": n}': no row ends before n tokens (a model that favours EOS), and a
    row's tokens still do not depend on what it is batched with."""
    model = _model()
    with torch.no_grad():
        model.lm_head.weight[1] += 2 * model.lm_head.weight.abs().max() * torch.sign(model.lm_head.weight[1])
    prompts, keys = [[5, 6, 7], [9, 10]], [row_key(0, 0, 0, 0), row_key(0, 0, 1, 0)]
    assert min(map(len, _completions(model, prompts, keys))) < 8  # EOS is drawn early without it
    together = _completions(model, prompts, keys, min_new_tokens=8)
    assert [len(c) for c in together] == [8, 8] and all(1 not in c for c in together)
    assert together == [_completions(model, [p], [k], min_new_tokens=8)[0] for p, k in zip(prompts, keys)]
