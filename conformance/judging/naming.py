"""How the suite shows tensors and long texts in what it reports (SPEC §4, 1.4).

A report names a tensor, never prints its values: a parameter's values are
dozens of lines of numbers that say nothing a reader can act on, where its
FQN, shape and dtype say what it is. Three ways in:

* :func:`describe` for a tensor the suite holds (its FQN where known);
* :func:`show`, a ``repr`` for messages that names every tensor inside;
* :func:`name_tensors`, for text that already holds a tensor's printout (an
  exception raised with a tensor in its text, a rank's traceback): each
  printout becomes its description, as far as the text tells it.

:func:`cut` shortens a long message and says how much it left out.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["cut", "describe", "name_tensors", "show"]

_ITEMS = 8  # items of a container :func:`show` lists before it counts the rest
_CHARS = 200  # characters of a string :func:`show` keeps


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(t: torch.Tensor, fqn: str | None = None) -> str:
    """``<DTensor '0.weight' shape=(8, 8) float32 cpu placements=(Shard(dim=0),) local=(2, 8)>``;
    any distributed value is named by its layout (``conformance.tensors``)."""
    from .. import tensors

    kind = type(t).__name__
    named = f" {fqn!r}" if fqn else ""
    distributed = tensors.is_distributed(t)
    parts = [f"shape={tuple(tensors.global_shape(t))}", _dtype(t.dtype)]
    parts.append(tensors.describe_layout(t) if distributed else str(t.device))
    if isinstance(t, torch.nn.Parameter) and not distributed and kind != "Parameter":
        kind += "(Parameter)"
    return f"<{kind}{named} {' '.join(parts)}>"


def show(obj: Any, names: Mapping[int, str] | None = None, depth: int = 0) -> str:
    """``repr(obj)`` with every tensor described (``names``: FQN by ``id``),
    containers cut after a few items and long strings cut, each with a count
    of what was left out."""
    if isinstance(obj, torch.Tensor):
        return describe(obj, names.get(id(obj)) if names else None)
    if isinstance(obj, str):
        return repr(obj) if len(obj) <= _CHARS else repr(obj[:_CHARS]) + f"…(+{len(obj) - _CHARS} chars)"
    if depth > 3 and isinstance(obj, (Mapping, list, tuple, set, frozenset)):
        return f"<{type(obj).__name__} of {len(obj)}>"
    if isinstance(obj, Mapping):
        items = [f"{show(k, names, depth + 1)}: {show(v, names, depth + 1)}" for k, v in list(obj.items())[:_ITEMS]]
        return "{" + ", ".join(items + _more(len(obj))) + "}"
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [show(v, names, depth + 1) for v in list(obj)[:_ITEMS]]
        if isinstance(obj, tuple):
            return "(" + ", ".join(items + _more(len(obj))) + ("," if len(obj) == 1 else "") + ")"
        body = ", ".join(items + _more(len(obj)))
        return f"[{body}]" if isinstance(obj, list) else (f"{{{body}}}" if obj else f"{type(obj).__name__}()")
    text = repr(obj)
    return name_tensors(text) if "tensor(" in text else text


def _more(n: int) -> list[str]:
    return [f"… and {n - _ITEMS} more"] if n > _ITEMS else []


# The start of a tensor's printout: torch's ``tensor(``, with the prefixes its
# subclasses print (``Parameter containing:``, DTensor's ``local_tensor=``).
_START = re.compile(r"(?:Parameter containing:\s*)?\btensor\((?=\s*(?:[\[\-\d.]|True|False|nan|inf))")
_DTENSOR = re.compile(r"\bDTensor\(local_tensor=")
_KEYWORD = re.compile(r",\s*(size|dtype|device|requires_grad|grad_fn|layout)=")


def name_tensors(text: str) -> str:
    """``text`` with each tensor printout in it replaced by a description:
    shape (from the brackets, or the ``size=`` torch prints when it
    summarises), dtype, device; ``values left out`` where the shape cannot be
    told. DTensors' printouts are named with their mesh and placements."""
    if "tensor(" not in text:
        return text
    out, at = [], 0
    while True:
        found = _first(text, at)
        if found is None:
            break
        start, body_start, dtensor = found
        end = _closing(text, body_start)
        if end is None:  # a printout cut off: name what is there
            end = len(text) - 1
        out.append(text[at:start])
        out.append(_named(text[body_start:end], dtensor, "Parameter containing" in text[start:body_start]))
        at = end + 1
    out.append(text[at:])
    return "".join(out)


def _first(text: str, at: int) -> tuple[int, int, bool] | None:
    """(where a printout starts, where its body starts, whether it is a DTensor's)."""
    plain = _START.search(text, at)
    dt = _DTENSOR.search(text, at)
    if dt is not None and (plain is None or dt.start() <= plain.start()):
        return dt.start(), dt.end(), True
    if plain is None:
        return None
    return plain.start(), plain.end(), False


def _closing(text: str, i: int) -> int | None:
    """The index of the parenthesis closing the one opened just before ``i``."""
    depth = 1
    for j in range(i, len(text)):
        ch = text[j]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return j
    return None


def _named(body: str, dtensor: bool, parameter: bool) -> str:
    if dtensor:
        inner = _START.search(body)
        local = ""
        if inner is not None:
            close = _closing(body, inner.end())
            if close is not None:
                local = " local " + _named(body[inner.end() : close], False, False)
                body = body[: inner.start()] + body[close + 1 :]
        rest = body.strip(", \n")
        rest = re.sub(r"\s+", " ", rest)
        return f"<DTensor{local}{', ' + rest if rest else ''}>"
    keywords = {m.group(1): m.start() for m in _KEYWORD.finditer(body)}
    values = body[: min(keywords.values())] if keywords else body
    fields = dict(re.findall(r"(size|dtype|device)=((?:\([^)]*\))|[^,)\s]+)", body))
    shape = fields.get("size") or _shape(values)
    dtype = fields.get("dtype", "").removeprefix("torch.") or _default_dtype(values)
    parts = [f"shape={shape}" if shape else "values left out"]
    parts += [p for p in (dtype, fields.get("device", "").strip("'\"")) if p]
    return f"<{'Parameter' if parameter else 'tensor'} {' '.join(parts)}>"


def _shape(values: str) -> str | None:
    """The shape a printout's brackets spell, or None where torch summarised
    (``...``) or the text does not parse."""
    values = re.sub(r"\b(?:inf|nan)\b", "0", values.strip())
    if not values or "..." in values:
        return None
    try:
        data = ast.literal_eval(values)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    dims = []
    while isinstance(data, list):
        dims.append(len(data))
        data = data[0] if data else None
    return str(tuple(dims))


def _default_dtype(values: str) -> str:
    """What torch leaves unprinted: float32 for floats, int64 for integers, bool."""
    if re.search(r"\b(True|False)\b", values):
        return "bool"
    if re.search(r"\d\.|\.\d|e[-+]?\d|\binf\b|\bnan\b", values):
        return "float32"
    return "int64" if re.search(r"\d", values) else ""


def cut(text: str, max_lines: int = 40, max_chars: int = 6000) -> str:
    """``text`` cut to ``max_lines`` lines and ``max_chars`` characters, the cut counted."""
    lines = text.splitlines()
    kept, size = [], 0
    for line in lines[:max_lines]:
        if size + len(line) > max_chars:
            line = line[: max(0, max_chars - size)]
            kept.append(line + f" … (+{len(text) - size - len(line)} chars cut)")
            return "\n".join(kept)
        kept.append(line)
        size += len(line) + 1
    if len(lines) > max_lines:
        kept.append(f"… ({len(lines) - max_lines} more lines cut)")
    return "\n".join(kept)
