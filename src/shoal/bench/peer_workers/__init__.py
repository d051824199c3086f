"""Standalone worker scripts for the peers (run by the peers' own python; no shoal imports)."""
