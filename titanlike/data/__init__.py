"""Data: tokenizers (tokenizer.py), dataset.json (dataset_info.py), the shard format (shards.py),
titanlike-prepare (prepare.py, sources.py), the built-in corpus (corpus.py), and sampling and loading
(loader.py)."""
