"""Leader election seam: only one autoscaler acts, in the operator process or `kvpilot autoscaler run`.

The Lease-based elector lives in kvpilot.operator.leader (the operator's module). The controller only
needs to ask "am I the leader now?", so it codes against this Protocol; `lease_elector()` adapts the
operator's module when it is installed and returns None when it is not.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

LEASE_NAME = "kvpilot-autoscaler"


@runtime_checkable
class LeaderElector(Protocol):
    @property
    def is_leader(self) -> bool: ...


class AlwaysLeader:
    """For a single instance (tests, the simulator, --no-leader-elect)."""

    @property
    def is_leader(self) -> bool:
        return True


def lease_elector(api_client: Any, namespace: str, identity: str, lease_name: str = LEASE_NAME) -> Any | None:
    """An elector from kvpilot.operator.leader, or None when that module is not available.

    The returned object has `is_leader` (property or method) and may have async `run()`/`start()`
    and `stop()`; the CLI drives whichever it has (see ``drive``).
    """
    try:
        module = importlib.import_module("kvpilot.operator.leader")
    except ModuleNotFoundError:
        return None
    for name in ("LeaseLeaderElector", "LeaderElector", "LeaseElector"):
        factory = getattr(module, name, None)
        if factory is None:
            continue
        params = inspect.signature(factory).parameters
        candidates = {
            "api_client": api_client,
            "namespace": namespace,
            "identity": identity,
            "name": lease_name,
            "lease_name": lease_name,
        }
        kwargs = {k: v for k, v in candidates.items() if k in params}
        return factory(**kwargs)
    log.warning("kvpilot.operator.leader has no known elector class; leader election is off")
    return None


def is_leader(elector: Any) -> bool:
    """Works with an `is_leader` property or method."""
    value = elector.is_leader
    return bool(value() if callable(value) else value)
