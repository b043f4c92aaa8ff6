"""torchtitan 0.3 (torch >= 2.13) set up for benchmarks/gpu/titan.py's worker: its llama3 model_registry (flavor 3B:
Llama-3.2-3B's shape, tied embeddings), its Trainer.Config, these rows. Imported by that worker only (after its
cpu_shim on CPU: torchtitan reads the device at import), when the installed torchtitan is 0.3.x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torchtitan.distributed.utils
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.config import CompileConfig, DebugConfig, TrainingConfig
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.tools.logging import init_logger
from torchtitan.trainer import Trainer

from benchmarks.common.launch import ROOT

FLAVORS = {"llama3_3b": "3B", "tiny": "debugmodel"}  # torchtitan's llama3 flavors (debugmodel: its own small shape)
SHAPED = {"llama3_3b"}  # the shapes whose flavor must equal peers.py's SHAPES
NOTES = [
    "torchtitan's Llama3Model: fused QKV, rope theta 500000 with its 'llama' frequency scaling (factor 8; peers.py's "
    "HF config has none), its own init (losses comparable to hfpar's in magnitude only)",
    "flex attention is compiled in every variant: titan's compile_s is not 0",
]


def stand_ins(attend) -> None:
    """CPU (titan.py's cpu_shim): SDPA with flex's own mask for the compiled flex call, no barrier after step 1."""
    FlexAttention._compiled_flex_attn = staticmethod(lambda *a, **kw: (attend(*a, **kw), None))
    torchtitan.distributed.utils.set_pg_timeouts = lambda **kw: None


def build(spec: dict, rows: list[dict], collate, lr: float) -> tuple[Trainer, dict]:
    """torchtitan 0.3's Trainer for titan.py's spec -> (trainer, {shape: the flavor's fields under SHAPES' names,
    cuda_graph})."""
    init_logger()  # its own step lines (loss, memory, tps, mfu) into the raw log, as its train.py does

    class Rows(IterableDataset):
        def __iter__(self):
            yield from rows

    class RowsLoader(ParallelAwareDataloader):  # torchtitan's dataloader hook: a Configurable with its own Config
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            pass

        def __init__(self, config, *, dp_world_size, dp_rank, local_batch_size, **kw):
            super().__init__(Rows(), dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size,
                             collate_fn=collate)  # fmt: skip

    cuda, (compiled, fp8) = spec["device"] == "cuda", spec["compile_fp8"]
    graph = cuda and spec["pad"] == "seq_len" and spec["attn"] == "flex"  # fixed shapes, no host sync (varlen has)
    fp8_cfg = Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=["lm_head"], emulate=not cuda,
                                           model_compile_enabled=compiled)  # on CPU: emulated, eager only  # fmt: skip
    converters = [fp8_cfg] if fp8 else None
    model_spec = model_registry(FLAVORS[spec["shape"]], attn_backend=spec["attn"], converters=converters)
    m, a = model_spec.model, model_spec.model.layers[0].attention
    got = dict(hidden_size=m.dim, intermediate_size=m.layers[0].feed_forward.w1.out_features,
               num_hidden_layers=len(m.layers), num_attention_heads=a.n_heads,
               num_key_value_heads=a.n_kv_heads or a.n_heads, vocab_size=m.vocab_size,
               tie_word_embeddings=m.enable_weight_tying, rope_theta=float(a.rope.theta))  # fmt: skip
    config = Trainer.Config(
        model_spec=model_spec, hf_assets_path=str(ROOT / "hfpar" / "assets" / "tiny"), dump_folder=spec["dump"],
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))),
        optimizer=default_adamw(lr=lr, betas=(0.9, 0.999), weight_decay=0.0),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0),  # constant
        training=TrainingConfig(local_batch_size=spec["batch"], seq_len=spec["seq_len"], steps=spec["steps"],
                                max_norm=1.0, disable_cuda_graphs=not graph),
        dataloader=RowsLoader.Config(), metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        activation_checkpoint=None, compile=CompileConfig(enable=compiled), debug=DebugConfig(seed=42),
    )  # fmt: skip
    return config.build(), {"shape": got, "cuda_graph": graph}
