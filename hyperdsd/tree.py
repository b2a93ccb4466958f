"""Nested state dicts: apply a function to every leaf, keeping the containers."""

from __future__ import annotations

from typing import Any, Callable


def rebuild(obj: Any, fn: Callable[[Any, tuple], Any], path: tuple = ()) -> Any:
    """A copy of ``obj`` with every leaf replaced by ``fn(leaf, path)``.

    Dicts, lists and tuples are containers; everything else is a leaf.
    """
    if isinstance(obj, dict):
        return {k: rebuild(v, fn, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(rebuild(v, fn, path + (i,)) for i, v in enumerate(obj))
    return fn(obj, path)


def where(path: tuple) -> str:
    return "".join(f"[{p!r}]" for p in path)
