"""Sequence classification (columns `text` and `label`); eval reports eval_loss and eval_accuracy.

With no arguments it trains the embedded tiny Llama on generated data (offline, < 2 min on 2 CPU cores):
    python recipes/classify.py
Any strategy is one config file away (add --num_processes 2 on a machine without GPU):
    accelerate launch --config_file accelerate_configs/ddp.yaml   recipes/classify.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/classify.py
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/classify.py
Real models and data, HF TrainingArguments names (or --config recipe.yaml with the same keys):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/classify.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name reviews.csv --output_dir out/classify \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --learning_rate 2e-5 --max_steps 1000
`python recipes/classify.py --help` lists every option.
"""

import gc

from hfpar.recipe import main

# the imported stack (torch, transformers, accelerate, datasets: ~3e5 objects) lives until exit: frozen, the collector
# no longer walks it, during the run nor at exit (-1 CPU-s per process, benchmarks/suite/launch_cost.py)
gc.freeze()

if __name__ == "__main__":
    main("classify")
