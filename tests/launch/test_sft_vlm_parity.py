"""The parity contract for image + text SFT (the sft recipe on a vision-language model), through `accelerate launch`.

fp32, a tiny random-init model saved with its processor (scripts/make_tiny_vlm.py), 48 shapes rows (PNG files named
by path, conversational prompt / completion, questions and answers of several lengths: padded rows), 8 optimizer
steps, accumulation 2, global batch 8, clipping active (max_grad_norm 0.5). The reference: one process in this
process (4 rows x 2 accumulation steps). Launched, each against it: loss and grad_norm per step within 1e-4
relative, eval_loss at steps 4 and 8, exported weights:
  ddp    2 processes x 2 rows (the vision tower and the language model replicated)
  tp2    --tp_size 2 (ddp.yaml, dp 1) x 4 rows: the language model's blocks sharded, each rank reading only its
         slices of the checkpoint (loading mode "sharded"), the vision tower replicated
  fsdp2  2 processes x 2 rows: FSDP2 shards of every parameter (the tower's too)
  zero3  2 processes x 2 rows: DeepSpeed ZeRO-3
Default tier (slow): idefics3's ddp + tp2 (one launch) and fsdp2; its exported directory loads with
AutoModelForImageTextToText and AutoProcessor and generates from an image, and `hfpar export` of its checkpoint-8
writes the same weights with the processor; resumed from its checkpoint-4 (same launch), steps 5-8 equal the
uninterrupted run's. Extended tier: idefics3's zero3, and
llava (a second family: CLIP tower, MLP projector) under all four. PP and CP refusals: tests/unit/test_sft_vision.py.

    python -m pytest -q -s tests/launch/test_sft_vlm_parity.py            # -m extended for the rest
"""

from __future__ import annotations

import threading

import pytest
from safetensors.torch import load_file

from tests.helpers import in_process
from tests.helpers.launch import launch_all, parity_launches, read_metrics, read_run_info
from tests.helpers.parity import TOL
from tests.helpers.vlm_sft import make_vlm_case

pytestmark = pytest.mark.slow

COMMON = [
    *("--max_steps", "8", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-3"),
    *("--lr_scheduler_type", "constant", "--max_grad_norm", "0.5", "--logging_steps", "1"),
    *("--eval_steps", "4", "--per_device_eval_batch_size", "2"),
]
LAYOUTS = {  # name: (config, processes, rows per device, extra flags)
    "ddp": ("ddp", 2, 2, []),
    "tp2": ("ddp", 2, 4, ["--tp_size", "2"]),
    # its checkpoint-4: resumed in the same launch; its checkpoint-8: `hfpar export` with the processor
    "fsdp2": ("fsdp2", 2, 2, ["--save_steps", "4"]),
    "zero3": ("zero3", 2, 2, []),
}
DEFAULT = {"idefics3": ("ddp", "tp2", "fsdp2")}
EXTENDED = {"idefics3": ("zero3",), "llava": tuple(LAYOUTS)}


def _case_name(family: str, layout: str) -> str:
    return f"{family}_{layout}"


def _runs(root, plan: dict) -> None:
    """The launches of plan {family: layouts} and, meanwhile, each family's one-process reference."""
    models = {f: make_vlm_case(root, f) for f in plan}
    cases = {_case_name(f, lay): (*LAYOUTS[lay], f) for f, lays in plan.items() for lay in lays}

    def argv(name, tag=""):
        cfg, n, bs, extra, family = cases[name] if name in cases else (None, 1, 4, [], name.split("_")[0])
        model, data = models[family]
        out = ["--model_name_or_path", model, "--dataset_name", data, "--output_dir", str(root / f"{name}{tag}")]
        return [*COMMON, *out, "--per_device_train_batch_size", str(bs), *extra]

    failed = []

    def launches():
        try:
            resumed = ("idefics3_fsdp2", 4) if "idefics3_fsdp2" in cases else None
            launch_all(parity_launches(root, "sft", cases, argv, resumed=resumed))
        except BaseException as e:  # noqa: BLE001 - raised below, in the test's thread
            failed.append(e)

    thread = threading.Thread(target=launches)  # the launches are mostly start-up: the references train meanwhile
    thread.start()
    try:
        for family in plan:
            if not (root / f"{family}_single" / "model.safetensors").exists():
                in_process.run_in_process("sft", argv(f"{family}_single"))
    finally:
        thread.join()
    if failed:
        raise failed[0]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("sft_vlm")


@pytest.fixture(scope="module")
def default_runs(root):
    _runs(root, DEFAULT)
    return root


@pytest.fixture(scope="module")
def extended_runs(root):
    _runs(root, EXTENDED)
    return root


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(abs(a), abs(b), 1e-12)


def _assert_export_matches(ref_dir, got_dir, what: str) -> None:
    """Exported weights within TOL per tensor (||got - ref|| / ||ref||), all but the vision towers' key biases: their
    gradient is zero in exact arithmetic (a query's scores all shift by the same q.b, which softmax ignores), so the
    optimizer's update there is Adam normalizing round-off noise (about +-lr per step, any sign, layout-dependent)."""
    ref, got = (load_file(str(d / "model.safetensors")) for d in (ref_dir, got_dir))
    assert ref.keys() == got.keys()
    worst = (0.0, "")
    for k in ref:
        if k.endswith("k_proj.bias"):
            continue
        diff = float((ref[k] - got[k]).norm() / ref[k].norm().clamp(min=1e-12))
        worst = max(worst, (diff, k))
        assert diff <= TOL, f"{what}: {k} relative diff {diff:.2e}"
    print(f"EXPORT {what}: max |got - ref| / |ref| {worst[0]:.2e} ({worst[1]})")


def _assert_parity(root, family: str, layout: str) -> None:
    name, ref_name = _case_name(family, layout), f"{family}_single"
    (ref, ref_eval), (got, got_eval) = read_metrics(root / ref_name), read_metrics(root / name)
    assert len(ref) == len(got) == 8
    worst = 0.0
    for r, g in zip(ref, got):
        assert g["num_target_tokens"] == r["num_target_tokens"]
        for k in ("loss", "grad_norm"):
            worst = max(worst, abs(g[k] - r[k]) / max(abs(r[k]), 1e-12))
            assert _close(g[k], r[k]), f"{name} step {r['step']} {k}: {g[k]} vs {ref_name} {r[k]}"
    assert [e["step"] for e in ref_eval] == [e["step"] for e in got_eval] == [4, 8]
    for r, g in zip(ref_eval, got_eval):
        assert _close(g["eval_loss"], r["eval_loss"]), f"{name} eval at step {r['step']}"
    print(f"PARITY {name}: worst loss / grad_norm relative diff {worst:.2e}")
    _assert_export_matches(root / ref_name, root / name, name)
    if layout == "tp2":  # the language model's slices read rank by rank from the checkpoint
        assert read_run_info(root / name)["loading"]["mode"] == "sharded"


@pytest.mark.parametrize("family,layout", [(f, lay) for f, lays in DEFAULT.items() for lay in lays])
def test_parity_with_single(default_runs, family, layout):
    _assert_parity(default_runs, family, layout)


@pytest.mark.extended
@pytest.mark.parametrize("family,layout", [(f, lay) for f, lays in EXTENDED.items() for lay in lays])
def test_parity_with_single_extended(extended_runs, family, layout):
    _assert_parity(extended_runs, family, layout)


def test_export_loads_with_its_processor_and_generates(default_runs):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = default_runs / "idefics3_fsdp2"  # FSDP2's shards gathered back
    model, proc = AutoModelForImageTextToText.from_pretrained(out), AutoProcessor.from_pretrained(out)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    image = Image.new("RGB", (32, 32), (230, 40, 40))
    enc = proc(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
    ids = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert ids.shape[1] == enc["input_ids"].shape[1] + 4


def test_resumed_run_continues_the_uninterrupted_one(default_runs):
    run, resumed = default_runs / "idefics3_fsdp2", default_runs / "idefics3_fsdp2_resumed"
    ref, got = read_metrics(run)[0][4:], read_metrics(resumed)[0]
    assert [r["step"] for r in got] == [5, 6, 7, 8]
    for r, g in zip(ref, got):
        for k in ("loss", "grad_norm"):
            assert abs(g[k] - r[k]) <= 1e-6 * max(abs(r[k]), 1.0), f"resumed step {r['step']} {k}: {g[k]} vs {r[k]}"
    _assert_export_matches(run, resumed, "idefics3_fsdp2 resumed")


def test_hfpar_export_of_a_checkpoint_keeps_the_processor(default_runs, tmp_path):
    from transformers import AutoProcessor

    from hfpar.checkpoint.export import export_checkpoint

    run = default_runs / "idefics3_fsdp2"
    export_checkpoint(run / "checkpoint-8", tmp_path / "out")
    assert type(AutoProcessor.from_pretrained(tmp_path / "out")).__name__ == "Idefics3Processor"
    a, b = (load_file(str(d / "model.safetensors")) for d in (run, tmp_path / "out"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
