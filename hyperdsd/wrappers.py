"""Wrapper layouts: where a training stack holds a model's parameters in a
layout of its own, the seam through which hyperdsd reads and loads them.

hyperdsd's calls work on the canonical layout: the model as written, each
parameter a tensor or a DTensor (plain, DDP, FSDP2, tensor parallel,
pipeline stages). A *wrapper layout* is one whose modules hold something
else in the parameters' place (one flat parameter per unit of modules,
sharded across ranks, say). It plugs in by one :class:`WrapperLayout`, registered
once (:func:`register`; :mod:`hyperdsd.api` registers hyperdsd's own):

- the index's walk of the model asks each module whether it is the layout's
  (:attr:`WrapperLayout.module_class`), which children it hides from FQNs
  and which of its parameters are the layout's own rather than the model's;
- a call on a model that has such modules works on its :class:`Twin`: the
  model and optimizers in the canonical layout, which a load lands into and
  then writes back through the twin's :class:`TwinLoad`.

A model the walk finds no wrapper in is its own twin (:func:`canonical`):
nothing is made or copied. A sketch of what a new layout implements::

    class MyLayout(WrapperLayout):
        name = "my-wrapper"

        @property
        def module_class(self):
            return MyWrapper  # the modules the index lists as this layout's

        def hidden_children(self, module):
            return {"_wrapped"} if "_wrapped" in module._modules else set()

        def is_own(self, param):
            return getattr(param, "_my_flat", False)  # left out of the model's parameters

        def twin(self, model, index, optims, modifiers_attr, *, to_load, full):
            ...  # a Twin: model, optimizers and index in the canonical layout,
            ...  # with a TwinLoad when ``to_load`` (what a load loads, and how)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol


class TwinLoad(Protocol):
    """A load's way on from a twin into the wrapper's own layout."""

    def land(self, model_plan, optim_plan) -> None:
        """Route a broadcast load's pieces straight to the wrapper's layout
        (called after planning, before the ranks agree; nothing moves before)."""

    def write_back(self, model_plan, optim_plan) -> None:
        """Write what the load changed in the twin into the wrapped model and optimizers."""


@dataclass
class Twin:
    """What a call reads or loads in place of a model and its optimizers.

    ``index`` is the twin model's :class:`~hyperdsd.state.keys.fqn.ModelIndex`;
    ``model_rounds`` and ``optim_rounds`` (or None) let a full get gather
    from the wrapper's own layout, a round of keys at a time (see :func:`hyperdsd.transport.consolidate.full_model`);
    ``load`` (a load's twin only) takes a load on from the twin."""

    model: Any
    optims: tuple
    index: Any
    model_rounds: Any = None
    optim_rounds: Any = None
    load: TwinLoad | None = None
    release: Callable[[], None] | None = None  # called when the call is done with the twin


class WrapperLayout:
    """One wrapper layout (see the module docstring). Subclasses set
    :attr:`name` and implement what the defaults here refuse."""

    name = "wrapper"

    @property
    def module_class(self) -> type | tuple[type, ...]:
        """The class (or classes) of the modules that are this layout's."""
        raise NotImplementedError

    def hidden_children(self, module) -> set[str]:
        """Names of ``module``'s children that do not appear in FQNs (asked of every module)."""
        return set()

    def is_own(self, param) -> bool:
        """Whether ``param``, found on one of this layout's modules, is the
        layout's own (not a parameter of the model as written)."""
        return False

    def twin(self, model, index, optims: tuple, modifiers_attr: str, *, to_load: frozenset[str], full: bool) -> Twin:
        """The twin of ``model`` (``index``: its index, listing this layout's
        modules in :attr:`~hyperdsd.state.keys.fqn.ModelIndex.wrapped`) and of ``optims``:
        for a load (``to_load``, the parts it loads, ``"model"`` and/or ``"optim"``,
        and ``"broadcast"`` where rank 0's dicts are sent to the others, whose
        :meth:`TwinLoad.land` is then called if the model's group has peers;
        with a :class:`TwinLoad`) or a get (``to_load`` empty; ``full``: a full
        get, which may gather from the wrapper's layout instead)."""
        raise NotImplementedError


_LAYOUTS: list[WrapperLayout] = []


def register(layout: WrapperLayout) -> None:
    """Make ``layout`` known to every index built after; it replaces one registered under its name."""
    _LAYOUTS[:] = [known for known in _LAYOUTS if known.name != layout.name]
    _LAYOUTS.append(layout)


def registered() -> tuple[WrapperLayout, ...]:
    return tuple(_LAYOUTS)


def canonical(model, index, optims: tuple) -> Twin:
    """A model in the canonical layout is its own twin."""
    return Twin(model, optims, index)
