"""torchtitan 0.2 (0.2.2, the newest release that trains on torch 2.11) set up for benchmarks/gpu/titan.py's worker.

Imported by that worker only (after its cpu_shim on CPU: torchtitan reads the device at import), when the installed
torchtitan is 0.2.x (tried: 0.2.2). 0.2 has no Llama-3 3B flavor and no weight tying in its llama3: for llama3_3b the
model args are built from peers.py's SHAPES (multiple_of = intermediate_size with the ffn_dim_multiplier that lands
on it) and TiedTransformer ties `output.weight` to `tok_embeddings.weight` (as 0.2's own qwen3 does); titan.py's
worker checks the fields, the tie and the parameter count against hfpar's model of that shape. tiny is its debugmodel
flavor (as 0.3's tiny). Either goes under a flavor of the shape's name in a TrainSpec registered as "hfpar_llama3"
(torchtitan's llama3 one with this model class and these rows). Its document mask is by EOS token
(llama3's block_causal: a document ends at its EOS), not by position ids as 0.3's: check_documents refuses rows whose
position restarts are not right after an EOS, and the pads are EOS tokens (each pad its own document, as 0.3's
position-0 pads; a row that ends mid-document gives its first pad to that document: label -100, after it causally).
"""

from __future__ import annotations

import dataclasses
import functools

import torchtitan.distributed.utils
import torchtitan.models.llama3.model.model as llama3_model
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.quantization.float8 import Float8LinearConverter
from torchtitan.config import JobConfig
from torchtitan.models.attention import FlexAttentionWrapper
from torchtitan.models.llama3 import Transformer, TransformerModelArgs, get_train_spec, llama3_args
from torchtitan.protocols.train_spec import register_train_spec
from torchtitan.tools.logging import init_logger
from torchtitan.train import Trainer

from benchmarks.common.launch import ROOT
from benchmarks.gpu.peers import SHAPES

NAME = "hfpar_llama3"  # the TrainSpec registered here
FLAVORS = {"llama3_3b": "SHAPES['llama3_3b']", "tiny": "debugmodel"}  # 0.2 has no 3B: built from peers.py's SHAPES
SHAPED = {"llama3_3b"}  # the shapes whose model must equal peers.py's SHAPES
NOTES = [
    "torchtitan 0.2 (0.3 needs torch >= 2.13): no 3B flavor, so its llama3 Transformer built from peers.py's SHAPES, "
    "output tied to the embedding here (0.2's llama3 has no tying; parameter count checked against hfpar's model)",
    "one GPU under torchtitan 0.2 = no FSDP: fp32 weights, bf16 torch.autocast (its single-device mixed precision)",
    "document mask by EOS token (0.2's block_causal; rows checked: each position restart follows an EOS), EOS pads",
    "loss: its plain cross-entropy over the whole logits (0.3's is chunked), no CUDA graph (0.2's Trainer has none)",
    "rope theta 500000 with its 'llama' frequency scaling (factor 8; peers.py's HF config has none), its own init "
    "(losses comparable to hfpar's in magnitude only)",
    "flex attention (and its block mask) compiled in every variant: titan's compile_s is not 0",
]


class TiedTransformer(Transformer):
    """torchtitan 0.2's llama3 Transformer with the head tied to the embedding (Llama-3.2's tie_word_embeddings)."""

    def __init__(self, model_args: TransformerModelArgs):
        super().__init__(model_args)
        self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device=None):
        self.output.weight = self.tok_embeddings.weight  # re-tied after to_empty (0.2's qwen3 does the same)
        super().init_weights(buffer_device=buffer_device)  # the head's truncated normal last (0.3's tied init too)


def model_args(shape: str, attn: str) -> TransformerModelArgs:
    """The shape's model args: torchtitan's own flavor (debugmodel) or built from SHAPES, with this attention."""
    if FLAVORS[shape] in llama3_args:
        return dataclasses.replace(llama3_args[FLAVORS[shape]], attn_type=attn, attn_mask_type="block_causal")
    s = SHAPES[shape]
    ffn = int(2 * 4 * s["hidden_size"] / 3)  # llama3 FeedForward's hidden size before ffn_dim_multiplier
    return TransformerModelArgs(
        dim=s["hidden_size"], n_layers=s["num_hidden_layers"], n_heads=s["num_attention_heads"],
        n_kv_heads=s["num_key_value_heads"], vocab_size=s["vocab_size"], multiple_of=s["intermediate_size"],
        ffn_dim_multiplier=s["intermediate_size"] / ffn, rope_theta=s.get("rope_theta", 10000.0), attn_type=attn,
        attn_mask_type="block_causal",
    )  # fmt: skip


def model_shape(m: Transformer) -> dict:
    """The model's fields under peers.py's SHAPES names."""
    a = m.model_args
    return dict(hidden_size=a.dim, intermediate_size=m.layers["0"].feed_forward.w1.out_features,
                num_hidden_layers=len(m.layers), num_attention_heads=a.n_heads,
                num_key_value_heads=a.n_kv_heads or a.n_heads, vocab_size=m.vocab_size,
                tie_word_embeddings=m.output.weight is m.tok_embeddings.weight,
                rope_theta=float(a.rope_theta))  # fmt: skip


def check_documents(rows: list[dict], eos: int) -> None:
    """0.2's document mask (by EOS) equals the rows' documents (by position ids) only if every position restart
    follows an EOS and every EOS before a row's last token is followed by one."""
    for i, r in enumerate(rows):
        ids, pos = r["input_ids"], r["position_ids"]
        starts = [j for j in range(1, len(ids)) if pos[j] == 0]
        if starts != [j + 1 for j in range(len(ids) - 1) if ids[j] == eos]:
            raise SystemExit(f"row {i}: documents by position ids {starts} != by EOS {eos} (0.2's document mask)")


def stand_ins(attend) -> None:
    """CPU (titan.py's cpu_shim): SDPA with flex's own mask for the compiled flex call, no barrier after step 1, the
    block mask made eagerly on the CPU (0.2's compiled create_block_mask takes its default device, cuda: RuntimeError,
    Unhandled FakeTensor Device Propagation for aten.bitwise_and.Tensor ... cuda:0, cpu), and fp8 emulated (0.2's
    converter drops `emulate` when a recipe is named; CPU _scaled_mm: per-tensor scaling only)."""
    FlexAttentionWrapper._compiled_flex_attn = staticmethod(attend)
    llama3_model.create_attention_mask = lambda *a, **kw: create_block_mask(*a, **kw, device="cpu")
    convert = Float8LinearConverter.__init__

    def emulated(self, job_config, parallel_dims):
        convert(self, job_config, parallel_dims)
        self.config = dataclasses.replace(self.config, emulate=True)

    Float8LinearConverter.__init__ = emulated
    torchtitan.distributed.utils.set_pg_timeouts = lambda **kw: None


def build(spec: dict, rows: list[dict], collate, lr: float) -> tuple[Trainer, dict]:
    """torchtitan 0.2's Trainer for titan.py's spec (its JobConfig, the TrainSpec registered here, these rows) ->
    (trainer, {shape: the model's fields under SHAPES' names, cuda_graph})."""
    init_logger()  # its own step lines (loss, memory, tps, mfu) into the raw log, as its train.py does

    class Rows(IterableDataset):
        def __iter__(self):
            yield from rows

    def loader(dp_world_size, dp_rank, tokenizer, job_config):
        check_documents(rows, tokenizer.eos_id)
        pad = functools.partial(collate, pad_id=tokenizer.eos_id)
        return ParallelAwareDataloader(Rows(), dp_rank=dp_rank, dp_world_size=dp_world_size,
                                       batch_size=job_config.training.local_batch_size, collate_fn=pad)  # fmt: skip

    base, tied = get_train_spec(), SHAPES[spec["shape"]]["tie_word_embeddings"] and spec["shape"] in SHAPED
    register_train_spec(NAME, dataclasses.replace(
        base, model_cls=TiedTransformer if tied else Transformer,
        model_args={spec["shape"]: model_args(spec["shape"], spec["attn"])},
        build_dataloader_fn=loader, build_validator_fn=None, pipelining_fn=None))  # fmt: skip
    cuda, (compiled, fp8) = spec["device"] == "cuda", spec["compile_fp8"]
    c = JobConfig()
    c.job.dump_folder = spec["dump"]
    c.model.name, c.model.flavor = NAME, spec["shape"]
    c.model.hf_assets_path = str(ROOT / "hfpar" / "assets" / "tiny")  # its HF tokenizer: the EOS id
    c.model.converters = ["quantize.linear.float8"] if fp8 else []  # its float8 converter's registered name
    f8 = c.quantize.linear.float8  # emulate: its SM89 gate on CPU, eager only (stand_ins makes the recipe emulated)
    f8.recipe_name, f8.filter_fqns, f8.emulate = "rowwise", ["output"], not cuda
    o = c.optimizer  # fused AdamW, hfpar's betas, no weight decay
    o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.implementation = lr, 0.9, 0.999, 1e-8, 0.0, "fused"
    c.lr_scheduler.warmup_steps, c.lr_scheduler.decay_ratio = 0, 0.0  # constant
    t = c.training
    t.local_batch_size, t.seq_len, t.steps, t.max_norm = spec["batch"], spec["seq_len"], spec["steps"], 1.0
    c.metrics.log_freq, c.metrics.disable_color_printing = 1, True
    c.activation_checkpoint.mode = "none"
    c.compile.enable = compiled
    c.debug.seed = 42
    trainer = Trainer(c)
    return trainer, {"shape": model_shape(trainer.model_parts[0]), "cuda_graph": False}
