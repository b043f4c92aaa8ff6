"""Continued pretraining of a causal LM on raw text (column `text`), packed into
--max_seq_length chunks (position ids restart at each document).

With no arguments it trains the embedded tiny Llama on generated data (offline, < 2 min on 2 CPU cores):
    python recipes/clm.py
Any strategy is one config file away (add --num_processes 2 on a machine without GPU):
    accelerate launch --config_file accelerate_configs/ddp.yaml   recipes/clm.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/clm.py
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/clm.py
Real models and data, HF TrainingArguments names (or --config recipe.yaml with the same keys):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/clm.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name corpus.txt --output_dir out/clm \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --learning_rate 2e-5 --max_steps 1000
`python recipes/clm.py --help` lists every option.
"""

import gc

from hfpar.recipe import main

# the imported stack (torch, transformers, accelerate, datasets: ~3e5 objects) lives until exit: frozen, the collector
# no longer walks it, during the run nor at exit (-1 CPU-s per process, benchmarks/suite/launch_cost.py)
gc.freeze()

if __name__ == "__main__":
    main("clm")
