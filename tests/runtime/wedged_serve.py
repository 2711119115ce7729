"""`kvpilot serve` with a model step that never returns: the engine loop wedges on the first request,
the way a stuck native call (a kernel, a deadlock, a grammar compiling for minutes) wedges it.

For tests only: it is a separate entry point under tests/, so nothing in a deployment can turn it on.
The process is the real CLI (`kvpilot.cli.main(["serve", ...])`: flags, signals, drain, exit); only
`ModelRunner.execute` is replaced. It prints WEDGED to stderr when a step enters the wedge.

    python tests/runtime/wedged_serve.py [kvpilot serve flags...]
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from kvpilot.cli import main
from kvpilot.runtime.engine.runner import ModelRunner

_NEVER = threading.Event()


def _wedged_execute(self: ModelRunner, scheduled: Any) -> Any:
    print("WEDGED", file=sys.stderr, flush=True)
    _NEVER.wait()  # releases the GIL, like a native call that never returns
    raise AssertionError("unreachable")


ModelRunner.execute = _wedged_execute  # type: ignore[method-assign]

if __name__ == "__main__":
    raise SystemExit(main(["serve", *sys.argv[1:]]))
