"""``horovod.runner.util.threads``: run functions on background threads (Horovod's helpers,
which its test utilities import)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["execute_function_multithreaded", "in_thread", "on_event"]


def in_thread(target: Callable[..., Any], args: tuple[Any, ...] = (), name: str | None = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Start ``target(*args)`` on a new thread and return it; ``silent`` swallows what it
    raises."""
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args).__name__}; for a single "
                         f"argument use (arg,)")
    fn = target
    if silent:
        def fn(*a: Any) -> None:
            with contextlib.suppress(Exception):
                target(*a)
    thread = threading.Thread(target=fn, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(event: threading.Event, func: Callable[..., Any], args: tuple[Any, ...] = (),
             stop: threading.Event | None = None, check_stop_interval_s: float = 1.0,
             daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Run ``func(*args)`` on a thread once ``event`` is set; a set ``stop`` (checked every
    ``check_stop_interval_s``) ends the thread without calling it."""
    if event is None:
        raise ValueError("Event must not be None")
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args).__name__}; for a single "
                         f"argument use (arg,)")
    if stop is None and not daemon:
        raise ValueError("Stop event must be given for non-daemon event thread")

    def wait_then_call() -> None:
        if stop is None:
            event.wait()
        else:
            while not event.is_set() and not stop.is_set():
                event.wait(timeout=check_stop_interval_s)
            if stop.is_set():
                return
        func(*args)

    return in_thread(wait_then_call, daemon=daemon, silent=silent)


def execute_function_multithreaded(fn: Callable[..., Any], args_list: Sequence[Sequence[Any]],
                                   block_until_all_done: bool = True,
                                   max_concurrent_executions: int = 1000
                                   ) -> dict[int, Any] | None:
    """Call ``fn(*args)`` for every ``args`` of ``args_list`` on at most
    ``max_concurrent_executions`` threads. Blocking, it returns ``{index: result}`` and
    raises RuntimeError if a call failed; otherwise None at once."""
    work: queue.Queue[tuple[int, Sequence[Any]]] = queue.Queue()
    for i, args in enumerate(args_list):
        work.put((i, args))
    results: dict[int, Any] = {}

    def drain() -> None:
        while True:
            try:
                i, args = work.get(block=False)
            except queue.Empty:
                return
            results[i] = fn(*args)

    threads = [in_thread(drain, daemon=not block_until_all_done)
               for _ in range(min(max_concurrent_executions, len(args_list)))]
    if not block_until_all_done:
        return None
    for thread in threads:
        while thread.is_alive():  # short joins, so that signals are handled meanwhile
            thread.join(0.1)
    if len(results) != len(args_list):
        raise RuntimeError(f"Some threads for func {getattr(fn, '__name__', fn)} did not "
                           f"complete successfully.")
    return results
