"""TRL equality, end to end: hfpar's grpo recipe and TRL 1.16's GRPOTrainer on the same tiny Llama, prompts, dense
reward and completions (TRL's rollout_func hands it hfpar's), one process, in-process, CPU, fp32, 4 optimizer steps
with num_iterations 2 (old log-probs, the importance ratio moves off 1, clipping active): per-step loss, grad norm,
reward, reward_std, kl, entropy and clip ratios equal within 1e-4 relative, for each loss type, with beta 0 and > 0,
token and sequence (GSPO) importance sampling; at a sampling temperature (the log-probs, KL and entropy of
softmax(logits / T), TRL's); with every completion of a step truncated and masked (a zero-loss step); with a reward
function that uses TRL's kwargs (trainer_state, log_metric, log_extra)."""

from __future__ import annotations

import json

import pytest

from benchmarks.grpo import trl_compare
from benchmarks.grpo.trl_compare import make_case, run_hfpar, run_trl

pytest.importorskip("trl")
TOL = 1e-4
pytestmark = pytest.mark.slow
CASES = [
    {"loss_type": "dapo"},
    {"loss_type": "grpo", "beta": 0.05},
    {"loss_type": "dr_grpo", "importance_sampling_level": "sequence"},
    {"loss_type": "bnpo", "beta": 0.05, "importance_sampling_level": "sequence"},
    {"loss_type": "cispo", "beta": 0.05},
    {"loss_type": "grpo", "beta": 0.05, "temperature": 0.7},  # TRL scores at the sampler's temperature
]
KEYS = ("loss", "grad_norm", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return make_case(tmp_path_factory.mktemp("grpo_trl"))


def _close(a: float, b: float, scale: float = 1e-6) -> bool:
    return abs(a - b) <= TOL * max(abs(a), abs(b), scale)


def _assert_steps_equal(ours, trl_rows, keys):
    assert len(trl_rows) == len(ours) == 4
    for step, (t, h) in enumerate(zip(trl_rows, ours), start=1):
        for key in keys + (("reward", "reward_std") if "reward" in h else ()):
            # the loss at ratio 1 is minus the mean advantage, 0 up to round-off (TRL's -3e-8): 1e-7 absolute there
            scale = 1e-3 if key == "loss" else 1e-6
            assert _close(h[key], t[key], scale), f"step {step} {key}: hfpar {h[key]} vs TRL {t[key]}"


@pytest.mark.parametrize("kw", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
def test_per_step_equal_to_trl(case, tmp_path, kw):
    kw = {"num_iterations": 2, "epsilon": 0.1, **kw}
    ours, completions = run_hfpar(*case, str(tmp_path / "hfpar"), **kw)
    trl = run_trl(*case, str(tmp_path / "trl"), completions, **kw)
    assert len(trl) == len(ours) == 4
    keys = KEYS + (("kl",) if kw.get("beta") else ())
    if kw["loss_type"] == "cispo":
        keys = tuple(k for k in keys if not k.startswith("clip_ratio")) + ("cispo_clip_ratio",)
    for step, (t, h) in enumerate(zip(trl, ours), start=1):
        for key in keys + (("reward", "reward_std") if "reward" in h else ()):
            # the loss at ratio 1 is minus the mean advantage, 0 up to round-off (TRL's -3e-8): 1e-7 absolute there
            scale = 1e-3 if key == "loss" else 1e-6
            assert _close(h[key], t[key], scale), f"step {step} {key}: hfpar {h[key]} vs TRL {t[key]}"
    assert any(h.get("clip_ratio/region_mean", h.get("cispo_clip_ratio", 0)) > 0 for h in ours), "no clipping"


def test_every_completion_masked_is_a_zero_loss_step(case, tmp_path, monkeypatch):
    """2-token completions, --mask_truncated_completions: step 1 has one completion that ends in EOS, every later
    step none; TRL clamps its token count to 1 and trains those steps with loss 0 (hfpar raised before)."""
    monkeypatch.setitem(trl_compare.COMMON, "completion", 2)
    kw = {"mask_truncated_completions": True}
    ours, completions = run_hfpar(*case, str(tmp_path / "hfpar"), **kw)
    trl_rows = run_trl(*case, str(tmp_path / "trl"), completions, **kw)
    _assert_steps_equal(ours, trl_rows, KEYS + ("completions/clipped_ratio",))
    assert [h["completions/clipped_ratio"] for h in ours[1:]] == [1.0, 1.0, 1.0]
    assert all(h["loss"] == 0.0 and h["grad_norm"] == 0.0 and h["num_target_tokens"] == 0 for h in ours[1:])


SEEN = ("global_step", "max_steps", "epoch", "num_train_epochs", "train_batch_size", "is_world_process_zero")
LETTER_SHARE = trl_compare.letter_share
RECORD = {"file": None}  # where kwargs_reward writes what it saw (one file per side)


def kwargs_reward(prompts, completions, letter, trainer_state, log_metric, log_extra, **kwargs):
    """letter_share, written against TRL's reward kwargs: records trainer_state (its type and fields), logs a metric
    twice a call (averaged over the calls) and a column."""
    with open(RECORD["file"], "a") as fh:
        seen = {k: getattr(trainer_state, k) for k in SEEN}
        fh.write(json.dumps({"type": type(trainer_state).__qualname__, **seen}) + "\n")
    log_metric("letters", float(len(completions)))
    log_metric("letters", 1.0)
    log_extra("chars", [len(c) for c in completions])
    return LETTER_SHARE(prompts, completions, letter)


@pytest.mark.parametrize("kw", [{"num_iterations": 2}, {"gradient_accumulation_steps": 2}], ids=["iter2", "accum2"])
def test_reward_kwargs_equal_to_trl(case, tmp_path, monkeypatch, kw):
    """trainer_state a transformers TrainerState with TRL's global_step, max_steps, epoch, ...; log_metric's mean in
    the step's record (metrics.jsonl) on the steps that generate; log_extra's column in completions.jsonl."""
    files = {side: tmp_path / f"{side}_seen.jsonl" for side in ("hfpar", "trl")}
    monkeypatch.setitem(RECORD, "file", files["hfpar"])
    ours, completions = run_hfpar(*case, str(tmp_path / "hfpar"), reward_funcs=f"{__name__}:kwargs_reward", **kw)
    monkeypatch.setitem(RECORD, "file", files["trl"])
    monkeypatch.setattr(trl_compare, "letter_share", kwargs_reward)  # TRL's run scores with it
    trl_rows = run_trl(*case, str(tmp_path / "trl"), completions, **kw)
    seen = {side: [json.loads(x) for x in f.read_text().splitlines()] for side, f in files.items()}
    assert seen["hfpar"] == seen["trl"], seen
    assert seen["trl"][0]["type"] == "TrainerState" and len(seen["trl"]) >= 2
    assert [h.get("letters") for h in ours] == [t.get("letters") for t in trl_rows]
    assert any(h.get("letters") for h in ours)
    assert all(isinstance(c.get("chars"), int) for c in completions)
