"""Synchronous ``dist_checkpointing.save`` without megatron's multiprocessing Manager.

megatron-core's ``torch_dist`` save strategy hands each rank's write results back through a
queue it creates once per process with ``multiprocessing.get_context("spawn").Manager().Queue()``:
the first save of every process starts a Manager server process (a fresh interpreter) just to
carry one small dict. That queue matters only for *asynchronous* saves, where the writer runs in
another process. We always save synchronously: the writer function runs in the calling process
(it forks its file writers and collects their results through queues of its own), puts its result
into that queue and the same process reads it back right after. A thread-safe in-process queue
does exactly that, without the extra process (about 1.5-3 s per rank and run on a 2-core box).
"""

from __future__ import annotations

import queue


def use_in_process_results_queue() -> None:
    """Give megatron's filesystem writer an in-process results queue if it has none yet
    (idempotent; call before a synchronous ``dist_checkpointing.save``). Never use it with
    megatron's asynchronous save (``async_sharded_save=True``), which this project does not."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "missing") is None:
        filesystem_async._results_queue = queue.Queue()
