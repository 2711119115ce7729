"""The checkout's part folders under their bare names.

The repository root holds the parts as folders (``kernels/``, ``runtime/``, ``router/``, ...), which
pyproject installs as ``kvpilot.<part>``; an installed wheel has no other top-level name. When Python
runs with the root on ``sys.path`` (pytest, ``python -m`` or ``python -c`` in a checkout), the import
system also finds each folder as a top-level package, shadowing any installed distribution of the same
name. transformers >= 5.25 depends on Hugging Face's ``kernels`` and imports it with every model class:
with the checkout's ``kernels/`` in its place, every transformers model failed to import in CI.

Each part's ``__init__`` calls `defer_to_installed` when it is imported under its bare name, so that
name means what it means outside the checkout. (``operator/`` does the same for the standard library's
``operator`` in its own way: that module is imported at start-up, before ``kvpilot`` can be.)
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def defer_to_installed(name: str, init_file: str) -> None:
    """Import the module `name` from ``sys.path`` without the checkout's root and put it in
    ``sys.modules[name]``, where the import statement that ran `init_file` picks it up. Where nothing
    else provides `name`, the folder stays the module, as before (its ``__init__`` holds no code)."""
    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(init_file))))
    path = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
