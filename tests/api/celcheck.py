"""Evaluate the CRD's validation rules locally, the way the API server does, with cel-python.

Only what the tests need: structural defaulting, `pattern`, and `x-kubernetes-validations`
(including transition rules with optionalOldSelf, whose `oldSelf` is an optional value).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from tests.needs import require_module

# Missing cel-python skips the CEL tests locally and fails them under CI.
celpy = require_module("celpy", "pip install -e .[test] (cel-python)")
celtypes = require_module("celpy.celtypes")
CELEvalError = require_module("celpy.evaluation").CELEvalError

_ABSENT = celtypes.StringType("__absent__")
_VALUE = celtypes.StringType("__value__")


class _Optional(celtypes.MapType):
    """CEL's optional type, enough for `x.hasValue()` and `x.value()`."""


def _optional(value: Any | None) -> _Optional:
    if value is None:
        return _Optional({_ABSENT: celtypes.BoolType(True)})
    return _Optional({_VALUE: celpy.json_to_cel(value)})


def _has_value(opt: _Optional) -> celtypes.BoolType:
    return celtypes.BoolType(_ABSENT not in opt)


def _value(opt: _Optional) -> Any:
    return opt[_VALUE] if _VALUE in opt else CELEvalError("optional.none() dereference")


_ENV = celpy.Environment()
_FUNCTIONS = {"hasValue": _has_value, "value": _value}
_PROGRAMS: dict[str, Any] = {}


def _program(rule: str) -> Any:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule), functions=_FUNCTIONS)
    return _PROGRAMS[rule]


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting: fill missing properties that have a default, recursively."""
    obj = copy.deepcopy(obj)
    if isinstance(obj, dict) and "properties" in schema:
        for name, child in schema["properties"].items():
            if name not in obj and "default" in child:
                obj[name] = copy.deepcopy(child["default"])
            if name in obj:
                obj[name] = apply_defaults(child, obj[name])
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        obj = [apply_defaults(schema["items"], item) for item in obj]
    return obj


def violations(schema: dict[str, Any], new: Any, old: Any | None = None, path: str = "") -> list[str]:
    """Messages of every rule and pattern `new` breaks (`old`: the stored object on update)."""
    out: list[str] = []
    if "pattern" in schema and isinstance(new, str) and not re.search(schema["pattern"], new):
        out.append(f"{path}: should match '{schema['pattern']}'")
    for rule in schema.get("x-kubernetes-validations") or []:
        transition = "oldSelf" in rule["rule"]
        if transition and old is None and not rule.get("optionalOldSelf"):
            continue
        activation: dict[str, Any] = {"self": celpy.json_to_cel(new)}
        if transition:
            activation["oldSelf"] = _optional(old) if rule.get("optionalOldSelf") else celpy.json_to_cel(old)
        result = _program(rule["rule"]).evaluate(activation)
        if result is not True and result != celtypes.BoolType(True):
            out.append(rule["message"])
    if isinstance(new, dict):
        for name, child in (schema.get("properties") or {}).items():
            if name in new:
                old_child = old.get(name) if isinstance(old, dict) else None
                out.extend(violations(child, new[name], old_child, f"{path}.{name}"))
    elif isinstance(new, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(new):  # list items are checked as new (no transition rules on them)
            out.extend(violations(schema["items"], item, None, f"{path}[{i}]"))
    return out
