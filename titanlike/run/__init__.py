"""The training loop's own parts, which the trainer consults at every step: the run's counters
(state.py), its stage (stage.py), what a non-finite loss does (nonfinite.py), stop requests and how a
stopped run ends (stopping.py), and a mixture's loss per source (source_losses.py)."""
