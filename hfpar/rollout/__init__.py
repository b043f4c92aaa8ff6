"""Online RL's pieces (GRPO and its variants), mesh-independent and TRL-exact:

    advantages.py    group-relative (GRPO, scale_rewards group | batch | none) and leave-one-out (RLOO) advantages
    policy_loss.py   the clipped policy-gradient loss per token for each --loss_type, GSPO's sequence-level importance
                     weights, the k3 KL to a reference, their aggregation as (sum, units) for the global normalization
    sampling.py      completions as a function of (seed, step, prompt, generation index): a generator per row
    rewards.py       reward functions: built-ins, `module.path:function` (TRL's signature), reward model directories
Not yet wired into a recipe: recipes/grpo.py is issue #39's remaining work.
"""
