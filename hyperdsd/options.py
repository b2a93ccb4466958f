"""Options: torch's ``StateDictOptions`` fields and defaults, and a resolver
that accepts our options, torch's, or any object with those attributes."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .errors import StateDictError


@dataclass
class StateDictOptions:
    """How get/set behave; the fields and defaults are torch's.

    - ``full_state_dict``: gather sharded tensors into full tensors on get;
      on set, values are full tensors that each rank slices for itself.
    - ``cpu_offload``: return CPU tensors; with ``full_state_dict`` only rank 0
      keeps the result and every other rank gets an empty dict.
    - ``ignore_frozen_params``: leave out parameters with ``requires_grad=False``.
    - ``keep_submodule_prefixes``: accepted for compatibility (submodule
      selection is deprecated upstream and not supported here).
    - ``strict``: on set, missing or unexpected entries raise, naming them.
    - ``broadcast_from_rank0``: on set, only rank 0's dict is read (the others
      may pass ``{}``); every rank receives only its own shards.

    "Rank 0" is the first rank of the model's process group: global rank 0
    for a model over the whole world; for a model whose meshes were built
    over part of the world (two models on disjoint halves), the lowest rank
    of its meshes, and only those ranks call (see :mod:`hyperdsd.transport.group`).
    - ``flatten_optimizer_state_dict``: one level of keys,
      ``state.{fqn}.{key}`` and ``param_groups.{fqn}.{field}``.
    - ``dsd_fqn_modifiers``: name of the method by which a module tells which
      child names do not appear in FQNs.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"


_FIELDS = tuple(f.name for f in fields(StateDictOptions))


def resolve_options(options) -> StateDictOptions:
    """Normalise ``options``; contradictions raise ``ValueError`` before any collective.

    Every rank that passes the same options raises the same error, so no rank
    is left waiting for another in a collective.
    """
    if options is None:
        return StateDictOptions()
    if isinstance(options, StateDictOptions):
        opts = options
    else:
        defaults = StateDictOptions()
        values = {name: getattr(options, name, getattr(defaults, name)) for name in _FIELDS}
        opts = StateDictOptions(**values)
    for name in _FIELDS[:-1]:
        if not isinstance(getattr(opts, name), bool):
            raise StateDictError(f"options.{name} must be a bool, got {getattr(opts, name)!r}")
    if opts.broadcast_from_rank0 and not opts.full_state_dict:
        raise StateDictError("options.broadcast_from_rank0=True requires full_state_dict=True")
    return opts
