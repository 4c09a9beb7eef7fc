"""What surrounds the training steps: the run folder (folder.py), metrics (metrics.py), the progress
line (progress.py), profiling (profiling.py), stop signals (stopping.py), the non-finite policy
(nonfinite.py), fault messages (faults.py), and torchrun as the launcher starts it (launch.py)."""
