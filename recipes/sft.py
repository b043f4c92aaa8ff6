"""Supervised fine-tuning of a causal LM (TRL-style data: messages | prompt/completion | text).
Loss on assistant / completion tokens only (--completion_only_loss false for all tokens); --packing
packs samples into rows without cross-sample attention (position ids restart per sample).

With no arguments it trains the embedded tiny Llama on generated data (offline, < 2 min on 2 CPU cores):
    python recipes/sft.py
Any strategy is one config file away (add --num_processes 2 on a machine without GPU):
    accelerate launch --config_file accelerate_configs/ddp.yaml   recipes/sft.py
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/sft.py
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/sft.py
Real models and data, HF TrainingArguments names (or --config recipe.yaml with the same keys):
    accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/sft.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name my_chats.jsonl --output_dir out/sft \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --learning_rate 2e-5 --max_steps 1000
A vision-language model trains on image + text rows (TRL's messages + images columns) through its processor; the
embedded tiny VLM on generated shapes (docs/recipes.md, "Images and text"):
    accelerate launch --config_file accelerate_configs/single.yaml recipes/sft.py --model_name_or_path hfpar-tiny-vlm
`python recipes/sft.py --help` lists every option.
"""

import gc

from hfpar.recipe import main

# the imported stack (torch, transformers, accelerate, datasets: ~3e5 objects) lives until exit: frozen, the collector
# no longer walks it, during the run nor at exit (-1 CPU-s per process, benchmarks/suite/launch_cost.py)
gc.freeze()

if __name__ == "__main__":
    main("sft")
