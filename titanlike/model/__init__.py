"""The model: its shape and presets (shape.py, plain Python), the decoder (decoder.py) and the loss (loss.py)."""
