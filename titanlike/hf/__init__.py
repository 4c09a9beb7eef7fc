"""Hugging Face interchange: config.json (config.py), safetensors and names (interchange.py),
titanlike-export (export.py) and titanlike-generate (generate.py)."""
