"""What the multi-process CPU tests share: every world size's gloo group started at once, one process
per rank, each running the test module's cases and writing its results as JSON.

A rank that hangs is killed after ``join_timeout_s`` (each group's own gloo timeout, 60 s, fires first),
and the fixture fails naming the (world size, rank) that hung or failed: a test never waits forever.

The rank processes are forked from a forkserver (where the platform has one; spawned otherwise): a fresh
process that imports kernel_pytorch and the test module once, before any rank starts, so that each rank
does not import torch and kernel_pytorch again (~5 s of CPU a process, 15 processes over the suite on CI's
2 cores). Each rank still starts clean: nothing of the pytest process (threads, dynamo caches, process
groups) is in the server.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_in_spawned_ranks"]

GROUP_TIMEOUT = datetime.timedelta(seconds=60)


def run_in_spawned_ranks(run_cases: Callable[[int], dict], world_sizes: Iterable[int], directory: Path,
                         join_timeout_s: float) -> dict[int, list[dict]]:
    """``{world size: [rank 0's run_cases(world_size), rank 1's, ...]}``. ``run_cases`` must be a
    module-level function (spawned processes import it by name)."""
    world_sizes = tuple(world_sizes)
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        # Read when the server starts (the first call of a pytest process); later modules' ranks import only
        # their own test module.
        context.set_forkserver_preload(["kernel_pytorch", run_cases.__module__])
    else:
        context = mp.get_context("spawn")
    processes = {}
    for world_size in world_sizes:
        for rank in range(world_size):
            process = context.Process(target=_rank_main, args=(rank, world_size, str(directory), run_cases))
            process.start()
            processes[world_size, rank] = process
    deadline = time.monotonic() + join_timeout_s
    for process in processes.values():
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [key for key, process in processes.items() if process.is_alive()]
    for key in hung:
        processes[key].kill()
    failed = {key: process.exitcode for key, process in processes.items() if process.exitcode != 0}
    assert not hung and not failed, f"rank processes hung {hung} or failed {failed} ((world size, rank): exit code)"
    return {world_size: [json.loads(Path(directory, f"world{world_size}_rank{rank}.json").read_text())
                         for rank in range(world_size)] for world_size in world_sizes}


def _rank_main(rank: int, world_size: int, directory: str, run_cases: Callable[[int], dict]) -> None:
    torch.set_num_threads(1)  # every rank of every group shares CI's 2 cores
    dist.init_process_group("gloo", init_method=f"file://{directory}/store_{world_size}", rank=rank,
                            world_size=world_size, timeout=GROUP_TIMEOUT)
    try:
        results = run_cases(world_size)
        # No rank tears the group down while another still talks to it: a rank whose peer had destroyed the
        # group first aborted once in CI ("terminate called without an active exception", exit code -6).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(directory, f"world{world_size}_rank{rank}.json").write_text(json.dumps(results))
