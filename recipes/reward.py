"""Reward-model training (sequence classification, one logit) with TRL's RewardTrainer semantics and names: prompt /
chosen / rejected or chosen / rejected data (standard or conversational, or tokenized chosen_ids / rejected_ids), an
optional `margin` column, --center_rewards_coefficient, --max_length (longer pairs left out, as TRL), --disable_dropout;
metrics accuracy, margin, mean_reward, min_reward, max_reward in metrics.jsonl (eval_* on the dataset's eval split).
The loss of a step, -log sigmoid(r_chosen - r_rejected [- margin]), is the mean over the pairs of the whole global
batch. The output directory is an HF sequence-classification model that GRPO takes as a reward function
(--reward_funcs <output_dir>).

With no arguments it trains the embedded tiny Llama on generated pairs (chosen = the right answer of the sft
task, rejected = a plausible wrong one; offline, about a minute on 2 CPU cores; eval accuracy rises from ~0.5):
    python recipes/reward.py
Any strategy is one config file away (add --num_processes 2 on a machine without GPU):
    accelerate launch --config_file accelerate_configs/ddp.yaml   recipes/reward.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/reward.py --tp_size 2
Real models and data:
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/reward.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name prefs.jsonl --output_dir out/rm \
        --per_device_train_batch_size 8 --learning_rate 1e-5 --max_length 1024 --center_rewards_coefficient 0.01
`python recipes/reward.py --help` lists every option.
"""

import gc

from hfpar.recipe import main

gc.freeze()  # as recipes/sft.py: the imported stack lives until exit

if __name__ == "__main__":
    main("reward")
