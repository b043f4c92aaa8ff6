"""Online RL's pieces (GRPO and its variants), mesh-independent and TRL-exact:

    advantages.py    group-relative (GRPO, scale_rewards group | batch | none) and leave-one-out (RLOO) advantages
    policy_loss.py   the clipped policy-gradient loss per token for each --loss_type, GSPO's sequence-level importance
                     weights, the k3 KL to a reference, their aggregation as (sum, units) for the global normalization
"""
