"""hfpar.parallel: parallel layers usable in any torch / Accelerate loop, and the sharding record under them.

comm.py              autograd-aware collectives in conjugate pairs (explicit group, no-op at size 1)
groups.py            process groups from rank lists (the one place new_group is called)
sharding.py          ShardSpec per parameter; grad norm, replicated-grad sync, full state dict on top of it
chunked_loss.py      the LM head + cross-entropy over token chunks (vocab-parallel aware; no full logits)
errors.py            ParallelError: a refusal with its fields (where, problems: reason + hint)
language_model.py    where a model's language model and its settings are (a multimodal wrapper's nested one)
tiny_copy.py         a tiny float64 copy of a model (its config's sizes shrunk): checks of what the model's code does
tensor_parallel/     column / row / vocab-parallel layers, plans as data, apply_tensor_parallel
expert_parallel/     router, grouped experts, all-to-all MoE layer, apply_expert_parallel, upcycling
context_parallel/    load-balanced sequence cut, ring / Ulysses attention ("hfpar_cp"), blockwise attention
pipeline/            stages of HF decoders, interleaved chunks, GPipe / 1F1B / interleaved 1F1B runner
"""
