"""Names for a process group's calls that recur from step to step.

A framework's process group (torch's c10d) has every rank issue a group's calls in the same
order, so a name made from the calls issued so far is the same on every rank. Naming each
call by a counter makes every name new (or, modulo a window, a name whose shape changes from
step to step), so the engine's name cache never applies. Here a call is named by its kind
and its place among the calls of that kind in the current training step: the k-th allreduce
of step t is ``allreduce.k.g``, ``g`` being ``t`` modulo ``generations``. A training loop
issues the same calls every step, so after its first few steps every name is one the engine
has negotiated with the same description before (one bit per call in a negotiation round).
The name leaves out shapes and dtypes on purpose: ranks that disagree on them propose the
same name with different descriptions, which the engine refuses at once as a mismatch.

Steps are found from the calls' *signatures* (kind, shapes, dtypes, op, root: what every
rank agrees on), the same way on every rank: the first signature seen twice becomes the
anchor (one-time calls before the loop never are), and a step ends when the anchor comes
again after other signatures did. Calls that form no steps (one signature, again and again)
take their places modulo ``window``; their descriptions are all alike, so their names hit
the cache once each was negotiated. A name comes back only ``generations`` steps (or
``window`` calls of its kind) later, by when the call that held it has long finished in a
training loop; in any case it must finish first (:meth:`CallNames.take` returns it, for the
caller to wait on), so no two calls in flight share a name. Waiting on it is rare by design:
a wait at submission is a wait on the caller's thread, which an asynchronous program that
issues two groups' calls in different orders on different ranks must never meet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["CallNames"]


class CallNames:
    """The names of one group's calls (the caller serialises :meth:`next`)."""

    def __init__(self, prefix: str, window: int = 256, generations: int = 4, *,
                 finished: Callable[[Any], bool] = lambda holder: True,
                 limit: int = 4096) -> None:
        self.prefix = prefix
        self.window = max(1, window)
        self.generations = max(1, generations)
        self._finished = finished
        self._limit = limit
        self._seen: set[str] = set()  # signatures seen before an anchor was chosen
        self.anchor: str | None = None  # the signature that opens a step
        self._others = False  # whether another signature came since the step opened
        self._places: dict[str, int] = {}  # kind -> calls of it in this step
        self._holders: dict[str, Any] = {}  # name -> the last call that used it
        self.steps = 0  # steps begun (for tests and diagnostics)

    def next(self, kind: str, signature: str) -> str:
        """The name of the next call, of ``kind``, whose signature is ``signature``."""
        if signature == self.anchor:
            if self._others:
                self._new_step()
        elif self.anchor is None:
            if signature in self._seen:  # the first signature seen twice: steps begin
                self.anchor = signature
                self._seen.clear()
                self._new_step()
            elif len(self._seen) < self._limit:
                self._seen.add(signature)
        else:
            self._others = True
        place = self._places.get(kind, 0)
        self._places[kind] = place + 1
        return f"{self.prefix}.{kind}.{place % self.window}.{self.steps % self.generations}"

    def _new_step(self) -> None:
        self._places.clear()
        self._others = False
        self.steps += 1

    def take(self, name: str) -> Any:
        """The call that last used ``name`` (None if none): it must finish before a new
        call of that name is submitted."""
        return self._holders.pop(name, None)

    def hold(self, name: str, holder: Any) -> None:
        """Record ``holder`` as the call now using ``name``."""
        if len(self._holders) >= self._limit:  # keep the ones still running
            self._holders = {n: h for n, h in self._holders.items() if not self._finished(h)}
        self._holders[name] = holder
