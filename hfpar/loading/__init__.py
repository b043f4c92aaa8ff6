"""Building the model a run trains: meta skeleton, each rank reading only its slices, upcycling, LoRA.

sharded.py   loading_mode, build_skeleton, load_sharded, fsdp2_loader
files.py     safetensors / .bin (zip, read without pickle) checkpoint files and their index
views.py     the slice of a checkpoint tensor a sharded parameter holds
upcycle.py   --upcycle_experts on the meta skeleton (each rank builds only its experts)
lora.py      PEFT LoRA adapters: applied before the data-parallel wrap, exported after training
sources.py   what a model / tokenizer / dataset dir is checked for before anything loads (no code, no adapter, ...)
contained.py nothing read from outside the directory named (links, index entries; HF cache snapshots allowed)
json_limits.py  bounded reads of an untrusted directory's JSON files
"""

from hfpar.parallel.exports import lazy_exports

# sharded.py imports transformers' conversion mapping and FSDP2: imported when a run loads, not by the preflight
__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".sharded": (
            "build_skeleton",
            "checkpoint_index",
            "fsdp2_loader",
            "load_sharded",
            "loading_mode",
            "resolve_checkpoint",
        ),
    },
)
