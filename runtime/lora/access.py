"""Who may load and unload LoRA adapters at run time (POST /v1/load_lora_adapter and
/v1/unload_lora_adapter): the pure decision, and the line `kvpilot serve` logs about it at start.

- Off unless `--enable-lora-runtime-updates` (404 naming that flag).
- With an API key set, the endpoints need it, like every `/v1` route.
- Without one they are refused (403 naming the flags) unless `--allow-lora-updates-without-api-key`
  opts in, which `kvpilot serve` warns about at start: anyone who reaches the port can then make the
  server read adapter folders from its disk.
"""

from __future__ import annotations

import logging

ENABLE_FLAG = "--enable-lora-runtime-updates"
WITHOUT_KEY_FLAG = "--allow-lora-updates-without-api-key"


def refusal(enabled: bool, has_api_key: bool, allow_without_key: bool) -> tuple[int, str, str] | None:
    """Pure: (HTTP status, error type, message) when the endpoints must refuse, None when they answer
    (the API key itself is checked for every `/v1` route before this)."""
    if not enabled:
        return (
            404,
            "not_found_error",
            f"loading and unloading LoRA adapters at run time is off on this server (start it with {ENABLE_FLAG})",
        )
    if not has_api_key and not allow_without_key:
        return (
            403,
            "permission_error",
            "loading and unloading LoRA adapters at run time needs an API key, and this server has none: "
            f"start it with --api-key (or KVPILOT_API_KEY), or allow it without a key with {WITHOUT_KEY_FLAG}",
        )
    return None


def startup_notice(enabled: bool, has_api_key: bool, allow_without_key: bool) -> tuple[int, str] | None:
    """Pure: (log level, message) for `kvpilot serve` to log at start, None when there is nothing to say."""
    if not enabled:
        return None
    if has_api_key:
        if allow_without_key:
            return (
                logging.INFO,
                f"{WITHOUT_KEY_FLAG} has no effect: an API key is set, and loading or unloading LoRA "
                "adapters at run time needs it",
            )
        return None
    if allow_without_key:
        return (
            logging.WARNING,
            f"{WITHOUT_KEY_FLAG}: POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer without an "
            "API key; any client that reaches this port can make the server load adapters from its disk "
            "(set --api-key or KVPILOT_API_KEY to require one)",
        )
    return (
        logging.WARNING,
        f"{ENABLE_FLAG} without an API key: POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer "
        f"403 (set --api-key or KVPILOT_API_KEY, or {WITHOUT_KEY_FLAG})",
    )
