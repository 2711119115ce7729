"""kvpilot.operator: reconciles InferenceModel resources into the runtime's pods (docs/operator.md).

This folder is the package ``kvpilot.operator`` (pyproject maps it). When Python runs with the
repository root on ``sys.path`` (``python -m pip`` from a checkout, for example) the import system
would also find this folder as the top-level ``operator``, shadowing the standard-library module that
``collections`` imports at startup, and every ``python -m`` would fail. In that case only, this file
becomes the standard library's ``operator``.
"""

if __name__ == "operator":  # pragma: no cover - exercised in a subprocess by tests/packaging
    import os as _os

    _stdlib_operator = _os.path.join(_os.path.dirname(_os.__file__), "operator.py")
    with open(_stdlib_operator, encoding="utf-8") as _f:
        exec(compile(_f.read(), _stdlib_operator, "exec"))
    del _os, _f, _stdlib_operator
