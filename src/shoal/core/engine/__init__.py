"""The engine: this process's collectives, negotiated across ranks, fused and run in order.

Its parts, each a module of its own (as Horovod's controller has a response cache, a tensor
queue, a stall inspector and fusion buffers):

- :mod:`.requests`: what is submitted (a named :class:`Request` of one :class:`Kind`).
- :mod:`.negotiator`: every rank's proposal in, one decision out; a pure function, no
  threads or sockets.
- :mod:`.names`: the name cache that lets a proposal name a known collective with one bit.
- :mod:`.stalls`: the stall inspector (blocked waits, overdue requests, their warnings).
- :mod:`.executor`: fusion buffers and the running of a decided round.
- :mod:`.small`: a cached small allreduce in one round, its payload riding the negotiation.
- :mod:`.neutral`: what a rank that has joined contributes to the others' allreduces.
- :mod:`.loop`: the :class:`Engine` that ties them: submission, waits, the background
  thread, rounds, join, failure.
"""

from .loop import Engine
from .requests import Kind, Request, mismatch_message

__all__ = ["Engine", "Kind", "Request", "mismatch_message"]
