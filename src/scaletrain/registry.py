"""Registries are plain dicts name -> factory; this is their one lookup with its one error."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def lookup(registry: dict[str, T], name: str, kind: str, plural: str = "") -> T:
    """registry[name], or ValueError naming the known entries."""
    if name not in registry:
        known = ", ".join(sorted(registry))
        raise ValueError(f"unknown {kind} {name!r}; known {plural or kind + 's'}: {known}")
    return registry[name]
