"""Walking nested state (dicts and lists of tensors), the suite's own.

The suite compares what an implementation returns; it keeps its own tree
helpers so that a bug in hyperdsd's cannot hide the same bug in hyperdsd.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator


def leaves(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """``(path, leaf)`` for every leaf of ``obj``, in order."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaves(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from leaves(value, (*path, i))
    else:
        yield path, obj


def rebuild(obj: Any, fn: Callable[[Any, tuple], Any], path: tuple = ()) -> Any:
    """A copy of ``obj`` with every leaf replaced by ``fn(leaf, path)``."""
    if isinstance(obj, dict):
        return {key: rebuild(value, fn, (*path, key)) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(rebuild(value, fn, (*path, i)) for i, value in enumerate(obj))
    return fn(obj, path)


def where(path: tuple) -> str:
    """A leaf's path as it would be written to index into the dict: ``['a'][0]``."""
    return "".join(f"[{part!r}]" for part in path)
