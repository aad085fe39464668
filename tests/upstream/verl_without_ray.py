"""Import verl's router-replay modules where Ray is absent (a GPU machine set up offline from .whl/).

Ray's cp312 wheel is 79 MB, left out of the pinned wheels the GPU checks install, and the replay
path never calls it: ``verl/__init__.py`` imports it through ``verl.protocol`` (``DataProto``), and
``verl/models/mcore/__init__.py`` through its model registry (``megatron_utils`` -> ``workers.config`` ->
``profiler`` -> ``single_controller``). ``install()`` registers those two packages with their search path
but without running their ``__init__`` (what ``importlib`` would do for a namespace package), so
``verl.utils.megatron.router_replay_patch``, ``router_replay_utils`` and ``verl.models.mcore.util`` - the
modules the tests exercise - are verl's own files, unchanged, and import as they do in a full install.
It also refuses ``import ray``, so a run on a machine that does have Ray proves the same thing.
Python's import system offers no switch for this; hence these few lines.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import types

SKIPPED_INITS = ("verl", "verl.models.mcore")


class _RefuseRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"import {name!r} refused: verl's replay modules must run without Ray "
                              "(tests/upstream/verl_without_ray.py)")
        return None


def install() -> None:
    """Register verl's two Ray-importing packages without their ``__init__`` and refuse Ray. Idempotent;
    raises ImportError if verl is not installed or was already imported the ordinary way."""
    if any(isinstance(f, _RefuseRay) for f in sys.meta_path):
        return
    for name in SKIPPED_INITS:
        if name in sys.modules and not getattr(sys.modules[name], "__moerl_without_init__", False):
            raise ImportError(f"{name} is already imported with its __init__; install() must run first")
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed (requirements/device.txt)")
    root = list(spec.submodule_search_locations)[0]
    for name in SKIPPED_INITS:
        path = os.path.join(root, *name.split(".")[1:])
        module = types.ModuleType(name)
        module.__path__ = [path]
        module.__file__ = None
        module.__moerl_without_init__ = True
        sys.modules[name] = module
        if "." in name:  # bind it on its parent, as the import system does
            parent, _, child = name.rpartition(".")
            setattr(importlib.import_module(parent), child, module)
    sys.meta_path.insert(0, _RefuseRay())
