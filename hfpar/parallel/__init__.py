"""hfpar.parallel: tensor-parallel and expert-parallel layers, usable in any torch / Accelerate loop.

    comm.py    autograd-aware collectives in conjugate pairs (explicit group, no-op at size 1)
    tensor.py  ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy
    plans.py   per-architecture TP plans as data;  apply.py  apply_tensor_parallel & friends
    router.py / moe.py  TopKRouter, GroupedExperts, MoELayer (expert-parallel all-to-all dispatch)
"""
