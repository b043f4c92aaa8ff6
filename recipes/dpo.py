"""Preference tuning (DPO) of a causal LM, TRL's DPOTrainer semantics and names: prompt / chosen / rejected data
(standard or conversational, implicit prompt), --beta, --loss_type sigmoid | hinge | ipo | robust | apo_zero |
sppo_hard, --label_smoothing, --reference_free, --precompute_ref_log_probs, --max_length / --truncation_mode,
--max_prompt_length / --max_completion_length; metrics rewards/chosen, rewards/rejected, rewards/accuracies,
rewards/margins, logps/chosen, logps/rejected in metrics.jsonl (eval_* with --eval_steps, on the dataset's eval
split). The loss of a step is the mean over the pairs of the whole global batch.

With no arguments it trains the embedded tiny Llama on generated pairs (chosen = the right answer of the sft
task, rejected = a plausible wrong one; offline, < 2 min on 2 CPU cores):
    python recipes/dpo.py
Any strategy is one config file away (add --num_processes 2 on a machine without GPU):
    accelerate launch --config_file accelerate_configs/ddp.yaml   recipes/dpo.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/dpo.py --tp_size 2
Real models and data:
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/dpo.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name prefs.jsonl --output_dir out/dpo \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --learning_rate 5e-7 --beta 0.1
`python recipes/dpo.py --help` lists every option.
"""

import gc

from hfpar.recipe import main

gc.freeze()  # as recipes/sft.py: the imported stack lives until exit

if __name__ == "__main__":
    main("dpo")
