"""Distributed checkpoints you can trust: manager.py decides when to save and what to resume,
writer.py writes and publishes a step folder, manifest.py is the gate every read passes, states.py
holds the pieces, weights.py reads a step's model weights, staging.py makes background copies,
folder.py names what is on disk."""
