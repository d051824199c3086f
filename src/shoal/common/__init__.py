"""Horovod's ``horovod.common`` paths, for scripts and tests that import them: build queries and
helpers (:mod:`.util`), the exceptions elastic training catches (:mod:`.exceptions`), process
sets, the elastic state classes and the per-framework "basics" object (:mod:`.basics`). All of
it is shoal's core under Horovod's names; nothing here imports a framework."""

__all__ = ["basics", "elastic", "exceptions", "process_sets", "util"]
