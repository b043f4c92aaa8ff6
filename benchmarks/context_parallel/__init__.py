"""Context parallelism: memory and length scaling (scaling.py), attention alone (attention.py, gpu_attention.py),
the recipe (recipe.py)."""
