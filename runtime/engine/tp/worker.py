"""A tensor-parallel worker (ranks 1..N-1): load this rank's shard, own its KV pool shard, and mirror
every step rank 0 runs, so the collectives inside the model meet.

The worker waits for messages on its pipe from rank 0 (runtime/engine/tp/distributed.py):
  execute  StepInputs   forward, then the logits of the sampled rows (their all-gather is collective)
  hidden   StepInputs   forward only (rank 0's `hidden_states()`)
  logits   (shape, dtype) receive rank 0's hidden rows by broadcast, compute their logits
  lora_add (name, path)   read an adapter into host memory (rank 0 checked it first); reply lora_added
  lora_remove name        forget an adapter; reply lora_removed
  kv_export (layer, block ids)         reply kv_exported: those blocks of this rank's pool (a KV transfer)
  kv_import (layer, block ids, data)   copy pulled blocks into this rank's pool (no reply)
  shutdown              leave the group and exit 0
Anything that goes wrong is reported as ("error", traceback) before the worker exits 1, which also
breaks the process group, so rank 0 fails its current collective at once instead of hanging.

Heavy imports happen inside `worker_main`: this module is imported by the spawned process before
the worker can set its environment.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpilot.runtime.engine.plan import RankPlan
    from kvpilot.runtime.engine.runner import ModelRunner
    from kvpilot.runtime.engine.tp.distributed import GroupSpec


def worker_main(rank: int, conn: Connection, spec: GroupSpec, plan: RankPlan) -> None:
    """Process entry point of rank `rank` (>= 1); `plan` is everything it needs, decided by rank 0."""
    # Ctrl-C reaches the whole process group; rank 0 decides when workers stop (a drain needs them).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from kvpilot.runtime.engine.tp.distributed import encode, leave_group

    try:
        runner = _start(rank, conn, spec, plan)
        _serve(conn, runner)
    except (EOFError, BrokenPipeError):
        pass  # rank 0 is gone: nothing to report to, just exit
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send_bytes(encode("error", traceback.format_exc()))
        leave_group()
        sys.exit(1)
    leave_group()


def _start(rank: int, conn: Connection, spec: GroupSpec, plan: RankPlan) -> ModelRunner:
    import torch

    from kvpilot.runtime.engine.runner import ModelRunner, apply_kernel_switches
    from kvpilot.runtime.engine.tp.distributed import decode, encode, join_group
    from kvpilot.runtime.engine.tp.runner import bind_rank_device, load_shard

    apply_kernel_switches(plan.cfg)  # as rank 0's engine build: before the shard is loaded
    torch.set_num_threads(plan.threads)
    torch.manual_seed(plan.cfg.seed)
    device = bind_rank_device(torch.device(plan.device_type), rank)
    conn.send_bytes(encode("joining"))  # imports worked: rank 0 may now wait in the rendezvous
    join_group(spec, rank)
    loaded, geometry, fits = load_shard(plan, device)
    conn.send_bytes(encode("loaded", fits))
    kind, num_blocks = decode(conn.recv_bytes())
    if kind != "kv_blocks":
        raise RuntimeError(f"expected the KV pool size, got {kind!r}")
    runner = ModelRunner(loaded.model, geometry, int(num_blocks), device)
    if loaded.lora is not None:
        runner.enable_lora(loaded.lora)
    conn.send_bytes(encode("ready"))
    return runner


def _serve(conn: Connection, runner: ModelRunner) -> None:
    import torch
    import torch.distributed as dist

    from kvpilot.runtime.engine.kv_transfer.blocks import export_run, import_run
    from kvpilot.runtime.engine.tp.distributed import decode, encode
    from kvpilot.runtime.engine.tp.runner import StepInputs

    model: Any = runner.model
    with torch.inference_mode():
        while True:
            kind, payload = decode(conn.recv_bytes())
            if kind == "shutdown":
                return
            if kind in ("execute", "hidden"):
                assert isinstance(payload, StepInputs)
                if runner.lora is not None:
                    runner.lora.apply(list(payload.lora_loads), payload.lora_token_slots)
                ids, positions, meta, sample_rows = payload.to_device(runner.device)
                # as rank 0's TPModelRunner._forward: the last layer on the sample rows alone
                # (every rank the same rows, so the collectives match), except under LoRA
                rows = sample_rows if kind == "execute" and runner.lora is None else None
                hidden = model(ids, positions, runner.kv_caches, meta, runner.backend, rows)
                if runner.lora is not None:
                    runner.lora.clear()  # the logits below do not go through a LoRA layer
                if kind == "execute" and sample_rows.numel():
                    model.compute_logits(hidden if rows is not None else hidden.index_select(0, sample_rows))
            elif kind == "logits":
                shape, dtype = payload
                hidden = torch.empty(shape, dtype=dtype, device=runner.device)
                dist.broadcast(hidden, src=0)
                model.compute_logits(hidden)
            elif kind == "kv_export":  # prefill side: this rank's blocks of one layer (kv_transfer/)
                layer, block_ids = payload
                conn.send_bytes(encode("kv_exported", bytes(export_run(runner.kv_caches[layer], block_ids))))
            elif (
                kind == "kv_import"
            ):  # decode side: pulled blocks into this rank's pool, before the next step
                layer, block_ids, data = payload
                import_run(runner.kv_caches[layer], block_ids, data)
            elif kind == "lora_add":
                name, path = payload
                runner.add_lora(name, path)
                conn.send_bytes(encode("lora_added"))
            elif kind == "lora_remove":
                runner.remove_lora(payload)
                conn.send_bytes(encode("lora_removed"))
            else:
                raise RuntimeError(f"unknown message {kind!r} from rank 0")
