"""Modules' registries of children, parameters and buffers, read a column at a time.

The kept model index (:mod:`hyperdsd.state.keys.index_cache`) asks on every call
whether the registries hold what they held; a load planned in place asks
again before it is applied. Both read nn.Module's private dicts (see
:func:`~.modules.child_modules`) for thousands of modules at once, in C.
"""

from __future__ import annotations

import itertools
import operator

import torch

from ..blocks import blocks

_REGISTRIES = tuple(operator.attrgetter(a) for a in ("_modules", "_parameters", "_buffers"))
_CHILDREN, _PARAMETERS, _BUFFERS = _REGISTRIES
_NON_PERSISTENT = operator.attrgetter("_non_persistent_buffers_set")


def module_registries(modules: list[torch.nn.Module]) -> list[dict]:
    """Every one of ``modules``' registry of children, then of parameters,
    then of buffers (as child_modules, own_parameters and own_buffers give
    them, read in C)."""
    return [*map(_CHILDREN, modules), *map(_PARAMETERS, modules), *map(_BUFFERS, modules)]


def registry_contents(registries: list[dict]) -> tuple[list, list, list]:
    """What ``registries`` (modules' dicts of children, parameters or buffers)
    hold, read in C: each one's length, then every name and every value in
    order. The lengths say where one registry's entries end: a module's last
    entry moved to the front of the next module's registry leaves the names
    and values in the same order. Empty registries add nothing to the names
    and values, and are left out of those passes."""
    full = list(filter(None, registries))
    names = list(itertools.chain.from_iterable(full))
    return list(map(len, registries)), names, list(itertools.chain.from_iterable(map(dict.values, full)))


def registries_fingerprint(modules: list[torch.nn.Module]) -> tuple[list, list, tuple[list, list]]:
    """What a walk of ``modules`` reads (see :mod:`hyperdsd.state.keys.index_cache`):
    their classes, each registry's length, names and the ids of what it
    holds, the non-persistent buffers' names (equal lists, the same
    registries, where everything they held is alive); every parameter then
    every buffer the registries hold, in order, None included; and
    :func:`registered`'s answer, from the same reads."""
    # The registries are nn.Module's private dicts (see child_modules), read a
    # column at a time in C (registry_contents): a Python loop over thousands
    # of modules costs more than the walk the comparison saves. Each column
    # is read in blocks of modules, joined after (see hyperdsd.blocks): the
    # four reads of a module's __dict__ then find it in cache.
    classes: list = []
    read: list[tuple[list, list, list]] = [([], [], []) for _ in _REGISTRIES]  # lengths, names, values
    persistence: tuple[list, list] = ([], [])  # non-persistent buffers: how many, and the names where any
    for block in blocks(len(modules)):
        some = modules[block]
        classes += map(type, some)
        for registry, whole in zip(_REGISTRIES, read):
            for column, part in zip(whole, registry_contents(list(map(registry, some)))):
                column += part
        non_persistent = list(map(_NON_PERSISTENT, some))
        persistence[0].extend(map(len, non_persistent))
        persistence[1].extend(set(names) for names in non_persistent if names)
    parts: list = [classes]
    for lengths, names, values in read:
        parts += [lengths, names, list(map(id, values))]
    parts += persistence
    (child_lengths, child_names, children), (param_lengths, param_names, params), (buf_lengths, buf_names, bufs) = read
    contents = [*child_lengths, *param_lengths, *buf_lengths, *child_names, *param_names, *buf_names]
    return parts, [*params, *bufs], (contents, [*children, *params, *bufs])


def registered(modules: list[torch.nn.Module]) -> tuple[list, list]:
    """:func:`registered_in` ``modules``' registries (:func:`module_registries`)."""
    return registered_in(module_registries(modules))


def registered_in(registries: list[dict]) -> tuple[list, list]:
    """What ``registries`` (modules' children, parameters and buffers by name)
    hold now: each one's length (where its names end) then every name, as one
    list; and every object they hold, in order."""
    lengths, names, held = registry_contents(registries)
    return [*lengths, *names], held
