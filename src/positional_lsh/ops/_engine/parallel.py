"""Run independent pieces of work on a pool of single-threaded workers.

Positional-LSH attention is many short kernel calls (one per block group, sample and head). With torch's
intra-op threads, every call is an OpenMP parallel region whose threads meet at a barrier; on a machine
where other processes compete for the cores, a descheduled thread stalls every barrier, and we measured
30x slowdowns on two busy cores. Independent heads have no such coupling: each worker thread runs whole
heads with one intra-op thread (``torch.set_num_threads`` is per thread for OpenMP), so the cores are used
without barriers and a busy machine only slows the work down by its share of the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def _single_threaded() -> None:
    torch.set_num_threads(1)


def _get_pool(size: int) -> ThreadPoolExecutor:
    with _lock:
        if size not in _pools:
            _pools[size] = ThreadPoolExecutor(size, thread_name_prefix="plsh", initializer=_single_threaded)
        return _pools[size]


def _call_in_modes(fn: Callable[[T], None], item: T, grad: bool, inference: bool) -> None:
    """``fn(item)`` under the caller's grad and inference modes (both are thread-local: workers do not inherit
    them, and in-place updates of tensors made under ``torch.inference_mode`` need that mode)."""
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        fn(item)


def workers_for(device: torch.device) -> int:
    """How many single-threaded workers to use for CPU tensors (1: run in the caller)."""
    return torch.get_num_threads() if device.type == "cpu" else 1


def run_all(fn: Callable[[T], None], items: Sequence[T], workers: int) -> None:
    """``fn(item)`` for every item; items must write disjoint outputs. Sequential when ``workers <= 1``."""
    if workers <= 1 or len(items) <= 1:
        for item in items:
            fn(item)
        return
    pool = _get_pool(workers)
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    futures = [pool.submit(_call_in_modes, fn, item, grad, inference) for item in items]
    for f in futures:
        f.result()


def work_items(heads: Sequence[tuple[T, int, float]], batch: int, workers: int) -> list[tuple[list[T], slice]]:
    """Independent pieces of work from ``(payload, kv_head, cost)`` per query head.

    A piece is all the query heads that share one key/value head (their key/value gradients accumulate
    into the same rows) for a slice of the batch, so pieces write disjoint parts of every output and
    gradient. The batch is split only as far as needed to feed the workers; the costliest pieces come
    first, so that the pool finishes together.
    """
    groups: dict[int, list[tuple[T, float]]] = {}
    for payload, kv_head, cost in heads:
        groups.setdefault(kv_head, []).append((payload, cost))
    if not groups:
        return []
    chunks = min(batch, max(1, -(-workers // len(groups)))) if workers > 1 else 1
    size = -(-batch // chunks)
    slices = [slice(a, min(batch, a + size)) for a in range(0, batch, size)]
    items = [(group, sl) for group in groups.values() for sl in slices]
    items.sort(key=lambda it: -sum(c for _, c in it[0]) * (it[1].stop - it[1].start))
    return [([payload for payload, _ in group], sl) for group, sl in items]


def pool_size(num_items: int, device: torch.device) -> int:
    """Workers for ``num_items`` pieces: 1 (intra-op threads in the caller) when there are too few pieces."""
    workers = workers_for(device)
    return workers if num_items >= workers else 1
