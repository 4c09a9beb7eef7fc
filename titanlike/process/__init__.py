"""The processes of a run: how run_train.sh starts torchrun (launch.py), how each level follows the one
that started it (lifeline.py), which rank's log is printed (logs.py), and how an out-of-memory or a
failed collective becomes one line (faults.py)."""
