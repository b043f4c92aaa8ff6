"""Loss = sum over real target tokens of the whole global batch / their number.

Simulates what the trainer does on dp ranks x accumulation steps (backward of
local_sum * dp * accum / N_global, Accelerate's 1/accum, the backend's mean over dp) on a batch
whose samples have very different numbers of target tokens, and checks that the gradient equals the
single-batch token mean, and that the naive mean of per-micro-batch means (the HF Trainer / TRL
bug class) does not.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hfpar.train.losses import IGNORE, lm_loss_sum


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(cfg).double()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (8, 12), generator=g)
    labels = ids.clone()
    # very different numbers of target tokens per sample: 11, 1, 1, 6, 2, 11, 1, 3
    for i, n in enumerate([11, 1, 1, 6, 2, 11, 1, 3]):
        labels[i, : 12 - n] = IGNORE
    return ids, labels


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _reference():
    model = _model()
    ids, labels = _batch()
    s, n = lm_loss_sum(model(input_ids=ids).logits, labels)
    (s / n).backward()
    return _grads(model), float(s / n)


def _simulated(dp, accum, naive=False):
    ids, labels = _batch()
    per = 8 // (dp * accum)
    n_global = int((labels[:, 1:] != IGNORE).sum())
    rank_grads, total = [], 0.0
    for r in range(dp):
        model = _model()
        for m in range(accum):
            sl = slice((m * dp + r) * per, (m * dp + r + 1) * per)  # the trainer's sampler layout
            s, n = lm_loss_sum(model(input_ids=ids[sl]).logits, labels[sl])
            loss = s / n if naive else s * (dp * accum) / n_global
            (loss / accum).backward()  # Accelerate divides by the accumulation steps
            total += float(s)
        rank_grads.append(_grads(model))
    return torch.stack(rank_grads).mean(0), total / n_global  # DDP / FSDP / ZeRO average over dp


def test_global_token_normalization_matches_single_batch():
    ref, ref_loss = _reference()
    for dp, accum in [(2, 2), (4, 1), (1, 4), (2, 1)]:
        got, loss = _simulated(dp, accum)
        assert torch.allclose(got, ref, rtol=1e-10, atol=1e-12), (dp, accum)
        assert abs(loss - ref_loss) < 1e-12


def test_mean_of_means_is_biased():
    ref, _ = _reference()
    naive, _ = _simulated(2, 2, naive=True)
    assert (naive - ref).norm() / ref.norm() > 1e-2
