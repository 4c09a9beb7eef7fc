"""titanlike-prepare: text in, the token shards and dataset.json that training reads out. Nothing
here runs during training.

cli.py is the command (and `--mix-report`, mix_report.py); driver.py's `prepare()` runs it:
readers.py finds the inputs and cuts them into chunks, workers.py tokenizes the chunks in parallel,
driver.py deals documents to train/ and val/ and writes their shards (data/shards.py's format) and
dataset.json, and output.py guards the output folder and publishes the result. The tokenizers are
data/tokenizer.py's, which training, the export and generation use too.
"""
