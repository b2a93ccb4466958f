"""Leaves of nested state dicts, by path, and back."""

from __future__ import annotations

from typing import Any, Callable, Iterator

Path = tuple


def leaves(obj: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every non-container value with its path; dicts, lists and tuples are containers."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, path + (k,))
    elif isinstance(obj, (list, tuple)) and not _is_atomic_sequence(obj):
        for i, v in enumerate(obj):
            yield from leaves(v, path + (i,))
    else:
        yield path, obj


def _is_atomic_sequence(obj) -> bool:
    # Hyperparameters such as betas=(0.9, 0.999) and params=["a", "b"] are
    # values, not containers of tensors.
    import torch

    return not any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in obj)


def map_tensors(obj: Any, fn: Callable) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    return obj


def set_path(root: dict, path: Path, value: Any) -> None:
    node = root
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
