"""Data. What training runs: tokenizers (tokenizer.py), dataset.json (dataset_info.py), the shard
format (shards.py), the built-in corpus (corpus.py), sources, phases and mixtures (schedule.py,
mixture.py, order.py), windows and the resumable loader (loader.py), and a run's data built from
[data] (build.py). What makes the data, before training: titanlike-prepare (prepare/: readers,
tokenizing workers, shard writing, the output folder, the mix report), which writes shards with
shards.py and records dataset.json; tokenizer.py serves both, and the export and generation too."""
