"""A fake pod (upstreams.FakePod) in a process of its own, so that a test can freeze it (SIGSTOP).

    python -m tests.router.pod_process --name p0 [--chunks 4] [--chunk-delay 0]

prints `listening <port>` once it serves on 127.0.0.1, then runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from tests.router.upstreams import FakePod


async def serve(pod: FakePod) -> None:
    await pod.start()
    print(f"listening {pod.port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await pod.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--chunk-delay", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(serve(FakePod(args.name, chunks=args.chunks, chunk_delay_s=args.chunk_delay)))


if __name__ == "__main__":
    main()
