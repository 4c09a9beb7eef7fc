"""Data. What training runs: tokenizers (tokenizer.py), the shard format (shards.py), the built-in
corpus (corpus.py), mixtures and sampling (mixture.py, order.py), windows and the resumable loader
(loader.py), and a run's data built from its resolved sources and phases (build.py). What makes the
data, before training: titanlike-prepare (prepare/: readers, tokenizing workers, shard writing, the
output folder, the mix report), which writes shards with shards.py and records dataset.json;
tokenizer.py serves both, and the export and generation too. What [data] names and dataset.json
records are the config's (config/sources.py, config/dataset.py)."""
