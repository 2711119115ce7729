"""Run an Argo CD Lua health check the way Argo CD does: Lua 5.1, `obj` a table made from the object's
JSON (objects become tables, arrays 1-indexed tables), only the base, table, string and math libraries,
and the script's `return hs` read back as {status, message}."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.charts.tools import ROOT
from tests.needs import missing

HEALTH_DIR = ROOT / "deploy" / "argocd" / "resource_customizations" / "kvpilot.dev" / "InferenceModel"
HEALTH_LUA = HEALTH_DIR / "health.lua"
ARGO_HEALTH = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def _runtime() -> Any:
    try:
        from lupa import lua51  # Lua 5.1, like Argo CD's gopher-lua
    except ImportError:
        missing("lupa with a Lua 5.1 runtime (Python module lupa)", "run `bash scripts/tools.sh`")
    lua = lua51.LuaRuntime(unpack_returned_tuples=True, register_eval=False)
    # Argo CD opens only base, table, string and math (plus its own safe os subset, unused here).
    lua.execute("os = nil; io = nil; debug = nil; package = nil; require = nil; dofile = nil; loadfile = nil")
    return lua


def _to_lua(lua: Any, value: Any) -> Any:
    if isinstance(value, dict):
        return lua.table_from({k: _to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([_to_lua(lua, v) for v in value])
    return value


def health(obj: dict[str, Any], script: Path = HEALTH_LUA) -> dict[str, str]:
    lua = _runtime()
    lua.globals().obj = _to_lua(lua, obj)
    fn = lua.eval(
        "function(src) local f, err = loadstring(src); if not f then error(err) end; return f() end"
    )
    result = fn(script.read_text())
    out = {"status": str(result["status"])}
    if result["message"] is not None:
        out["message"] = str(result["message"])
    if out["status"] not in ARGO_HEALTH:
        raise AssertionError(f"health.lua returned {out['status']!r}, not an Argo CD health status")
    return out
