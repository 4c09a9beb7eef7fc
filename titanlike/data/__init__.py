"""Data: tokenizers (tokenizer.py), the shard format (shards.py), titanlike-prepare (prepare.py,
sources.py, mix_report.py), the built-in corpus (corpus.py), mixtures and sampling (mixture.py,
order.py), loading (loader.py), and a run's data built from its resolved sources and phases (build.py).
What [data] names and dataset.json records are the config's (config/sources.py, config/dataset.py)."""
