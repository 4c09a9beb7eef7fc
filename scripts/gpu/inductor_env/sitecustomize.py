"""Inductor options from the environment, for GPU experiments only: put this folder first on
PYTHONPATH and set TL_INDUCTOR="a.b=value,c=value" (True/False become booleans). Python imports
sitecustomize at start-up in every process, torchrun's workers included; the options are part of
inductor's cache key, so one warm cache serves runs with different options."""

import os

if os.environ.get("TL_INDUCTOR"):
    import torch._inductor.config as config

    for item in os.environ["TL_INDUCTOR"].split(","):
        key, value = item.split("=")
        setattr(config, key, {"True": True, "False": False}.get(value, value))
