"""Building the model a run trains: meta skeleton, each rank reading only its slices, upcycling, LoRA.

sharded.py   loading_mode, build_skeleton, load_sharded, fsdp2_loader
files.py     safetensors / .bin (zip, read without pickle) checkpoint files and their index
views.py     the slice of a checkpoint tensor a sharded parameter holds
upcycle.py   --upcycle_experts on the meta skeleton (each rank builds only its experts)
lora.py      PEFT LoRA adapters: applied before the data-parallel wrap, exported after training
"""
