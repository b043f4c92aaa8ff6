"""hfpar.parallel: parallel layers usable in any torch / Accelerate loop, and the sharding record under them.

    comm.py              autograd-aware collectives in conjugate pairs (explicit group, no-op at size 1)
    groups.py            process groups from rank lists (the one place new_group is called)
    sharding.py          ShardSpec per parameter; grad norm, replicated-grad sync, full state dict on top of it
    tensor_parallel/     column / row / vocab-parallel layers, plans as data, apply_tensor_parallel
    expert_parallel/     router, grouped experts, all-to-all MoE layer, apply_expert_parallel, upcycling
"""
