"""Example training applications built on shoal's public API."""
