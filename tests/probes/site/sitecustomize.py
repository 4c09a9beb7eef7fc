"""Imported at start-up by every Python process a test starts (conftest.py puts this folder on their
PYTHONPATH): with TITANLIKE_NAN_BATCHES set, installs the NaN probe (nan_batches.py) as soon as
titanlike's loss module has been imported, before the trainer takes build_loss from it."""

import os
import sys

if os.environ.get("TITANLIKE_NAN_BATCHES"):
    import importlib.abc
    import importlib.machinery

    class _InstallAfterLossModule(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "titanlike.model.loss":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                sys.modules[name] = module
                import nan_batches

                nan_batches.install()

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _InstallAfterLossModule())
