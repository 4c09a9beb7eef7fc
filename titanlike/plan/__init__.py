"""Will a run fit, and what would make it fit: the per-GPU memory of a config at a world size
(estimate.py), the levers that lower it and what each costs in speed (levers.py), the fastest
combination that fits a target (fit.py, `--training.fit_gib`), and `titanlike-plan` (cli.py).
Plain Python, like config/: it imports config/ and model/'s shapes, never torch, so the preflight and
the planner answer in a fraction of a second on a machine without a GPU."""
