"""Online RL (GRPO and its variants) of a causal LM on rewards, TRL's GRPOTrainer semantics and names: prompt-only
data (a `prompt` column, standard or conversational; other columns go to the reward functions), --reward_funcs
(exact_match | numeric_match | module.path:function | a reward-model directory) and --reward_weights,
--num_generations, --generation_batch_size / --steps_per_generation, --num_iterations, --max_completion_length,
--temperature / --top_p / --top_k, --loss_type grpo | dr_grpo | dapo | bnpo | cispo, --importance_sampling_level
token | sequence (GSPO), --epsilon / --epsilon_high / --delta, --scale_rewards group | batch | none,
--mask_truncated_completions, --beta (KL to a reference), --advantage_estimator rloo; metrics reward, reward_std,
rewards/<name>/mean, completions/*, kl, entropy, clip_ratio/* and the step's generation time in metrics.jsonl.

The policy generates with its own parallel layout (TP shards, EP experts, FSDP2 / ZeRO-3 parameters), and each
completion is a function of (seed, step, prompt, generation index) and the weights, never of the mesh.

With no arguments it trains a warm-started tiny Llama on a generated task with a checkable answer (offline, < 2 min
on 2 CPU cores; report.png shows the reward rising):
    python recipes/grpo.py
Any strategy is one config file away (add --num_processes 2 on a machine without GPU):
    accelerate launch --config_file accelerate_configs/ddp.yaml   recipes/grpo.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py --tp_size 2
Real models and data:
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/grpo.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name prompts.jsonl --output_dir out/grpo \
        --reward_funcs numeric_match,my_rewards:format_reward --num_generations 8 --max_completion_length 512
`python recipes/grpo.py --help` lists every option.
"""

import gc

from hfpar.recipe import main

gc.freeze()  # as recipes/sft.py: the imported stack lives until exit

if __name__ == "__main__":
    main("grpo")
