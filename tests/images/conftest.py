"""The image tests build and run containers (Docker; a cold build takes about 15 minutes and 25 GB of
disk): an explicit group, run by `./dev test-images`, not by `./dev test` (CI's command) until CI's
machines are known to run dockerd. `KVPILOT_IMAGE_TESTS=1` selects it; inside the group a missing
docker or daemon skips locally and fails under CI=true (tests/needs.py)."""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("KVPILOT_IMAGE_TESTS") == "1" else ["test_*.py"]
