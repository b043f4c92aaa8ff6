"""Regional compilation: each decoder block compiled on its own (--torch_compile), as torchtitan and Accelerate's
regional compilation do; the embeddings, the LM head and the loss stay eager.

    report = compile_blocks(model, backend="inductor", mode=None)   # in place, after the parallel layers
    compile_seconds()                                               # dynamo's compile time so far (all blocks)

Every block of the repeated stack (the outermost ModuleList whose children are all one class: a decoder's layers)
gets `block.compile(...)`, in place: the module stays itself (same class, same parameter names, so checkpoints,
the export and the planner see the same model) and its call still goes through nn.Module's hooks, so FSDP2's
per-block all-gather / reshard (fully_shard after this), activation checkpointing (around the call) and the
pipeline stage split (which holds the same block objects) keep working. The blocks are alike: the first one's
graphs are reused by the others (one compile, not one per layer).

Why not accelerate.utils.compile_regions: it returns a new model whose blocks are torch.compile's OptimizedModule
wrappers (parameter names gain `_orig_mod.`, and hooks installed later on the block are bypassed); its in-place
variant compile_regions_fsdp2 also compiles every non-repeated leaf (the embeddings, the LM head), which hfpar
replaces or shards itself (the chunked / vocab-parallel loss head, pipeline stages without them).

The lazy compile happens at the first forward, under whatever parallel layers the block holds (TP's collectives,
EP's all-to-all and CP's ring run inside it: dynamo traces them or breaks the graph around them; both are exact).
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch import nn


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of the outermost ModuleList whose children are all of one class (a decoder's layers; the
    experts inside a block are not looked at once the block is found)."""
    for module in model.modules():
        kids = list(module.children()) if isinstance(module, nn.ModuleList) else []
        if kids and len({type(k) for k in kids}) == 1 and any(True for _ in kids[0].parameters()):
            return kids
    return []


def compile_blocks(model: nn.Module, backend: str = "inductor", mode: str | None = None) -> dict:
    """Compiles each repeated block in place; returns what run_info.json records (compile_s filled by the trainer).
    ValueError in one line if the model has no repeated blocks to compile."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(
            f"--torch_compile: {type(model).__name__} has no stack of repeated blocks (a ModuleList of one layer "
            "class) to compile regionally; drop --torch_compile"
        )
    # a run's blocks compile from an empty cache: several runs in one process (the tests' shared launches) would
    # otherwise pile up compiled variants of nn.Module's call (one code object for every block) until dynamo's
    # recompile limit made it run the blocks eagerly; compile_seconds() counts this run's compiles only
    torch._dynamo.reset()
    kwargs = {"backend": backend, **({"mode": mode} if mode not in (None, "default") else {})}
    for block in blocks:
        block.compile(**kwargs)
    return {"backend": backend, "mode": mode or "default", "regions": len(blocks), "region": type(blocks[0]).__name__}


def compile_seconds() -> float:
    """Seconds dynamo spent compiling in this process so far (forward and backward graphs, all blocks)."""
    return round(float(torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0)), 3)
