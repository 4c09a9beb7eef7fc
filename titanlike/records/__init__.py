"""What a run leaves behind and shows: its dump folder's lock and records (folder.py), metrics.jsonl,
TensorBoard and Weights & Biases (metrics.py, wandb_sink.py), the progress line (progress.py) and
profiles and memory snapshots (profiling.py). None of it changes what trains."""
