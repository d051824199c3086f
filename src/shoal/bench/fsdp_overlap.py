"""How much of FSDP2's communication its prefetching hides, for any torch backend.

While a few training steps run, every all-gather and reduce-scatter that FSDP2 issues is
recorded (its kind, tensors' shapes and dtype), and the training thread's time inside the
issuing calls and blocked in ``Work.wait`` is summed: the *exposed* communication. Then the
recorded collectives are replayed back to back on the same group with no computation between
them: the communication *alone*. What prefetching and asynchronous reduce-scatters hide is the
difference; ``hidden = 1 - exposed / alone``.

The patches are class- and module-level (FSDP2 checks ``isinstance(work, Work)``, so works
cannot be wrapped) and are undone on leaving :func:`measure`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["measure"]

_CALLS = ("all_gather_single", "reduce_scatter_single")


def _copy(value: Any) -> Any:
    """A tensor's copy (the replay must not write into the model's buffers), else as is."""
    return value.clone() if hasattr(value, "clone") and hasattr(value, "shape") else value


@contextlib.contextmanager
def _recording(dist: Any, work_types: tuple[type, ...]) -> Iterator[dict[str, Any]]:
    seen: dict[str, Any] = {"calls": [], "exposed_s": 0.0}
    saved_calls = {name: getattr(dist, name) for name in _CALLS}
    saved_waits = {cls: cls.__dict__["wait"] for cls in work_types}

    def timed_call(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen["calls"].append((name, args, kwargs))
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seen["exposed_s"] += time.perf_counter() - t0
        return call

    def timed_wait(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                seen["exposed_s"] += time.perf_counter() - t0
        return wait

    try:
        for name, fn in saved_calls.items():
            setattr(dist, name, timed_call(name, fn))
        for cls, fn in saved_waits.items():
            cls.wait = timed_wait(fn)
        yield seen
    finally:
        for name, fn in saved_calls.items():
            setattr(dist, name, fn)
        for cls, fn in saved_waits.items():
            cls.wait = fn


def measure(dist: Any, work_types: tuple[type, ...], step: Callable[[], None],
            steps: int) -> dict[str, float]:
    """Per step: the step's time, the communication exposed to the training thread, the same
    collectives alone, and the share hidden. ``work_types``: the classes whose ``wait`` the
    backends' works use (each must define ``wait`` itself)."""
    with _recording(dist, work_types) as seen:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        step_s = (time.perf_counter() - t0) / steps
    replay = [(getattr(dist, name), [_copy(a) for a in args],
               {k: _copy(v) for k, v in kwargs.items() if k != "async_op"})
              for name, args, kwargs in seen["calls"]]
    dist.barrier(group=replay[0][2].get("group") if replay else None)
    t0 = time.perf_counter()
    for fn, args, kwargs in replay:
        fn(*args, **kwargs)
    alone_s = (time.perf_counter() - t0) / steps
    exposed_s = seen["exposed_s"] / steps
    return {"step_s": step_s, "alone_s": alone_s, "exposed_s": exposed_s,
            "hidden": max(0.0, 1.0 - exposed_s / alone_s) if alone_s > 0 else 0.0,
            "collectives": len(replay) / steps}
