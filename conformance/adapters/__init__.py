"""The implementation under test (IUT), behind one small interface.

``--impl NAME`` picks it:

* ``hyperdsd`` or ``torch`` (``torch.distributed.checkpoint.state_dict``);
* ``some.module``: a module with the four functions and ``StateDictOptions``
  under torch's names works as it is (with ``get_state_dict`` and
  ``set_state_dict`` too, when it has both); a module may instead define
  ``conformance_adapter`` (an :class:`Adapter`, or a function returning one);
* ``some.module:attr``: an :class:`Adapter`, a function returning one, or an
  object with the four functions.

An adapter may rename functions, build its own options, shard models its own
way (default: ``fully_shard``), claim optional profiles, declare what the
implementation supports (SPEC §1: the modes of its get and of its load apart,
the layouts, the options; default: everything) and name its DCP load path (a
load planner factory; a module names it as ``DCP_LOAD_PLANNER``; default:
none, DCP's default planner).

A stack with a distributed tensor of its own (SPEC §1, 1.6) also says how
the suite reads its values (``tensors``, a
:class:`conformance.tensors.TensorProtocol`; default torch's DTensor), what
context its optimizers run in (``training``), how it builds its own mesh from
the suite's description (``mesh``), and its own checkpoint functions for the
``dcp`` mode (``save_checkpoint``, ``load_checkpoint``; default DCP).

A pass is the implementation's own (SPEC §4). An adapter whose functions are
not the implementation's own wraps each call into the implementation in
``with iut_call():``; an error a clause expects counts only when it is raised
inside it. Where the implementation lacks something a case asks for, the
adapter refuses before calling it, with ``raise Unsupported("...")`` (or
``NotImplementedError``): the case is not applicable, never passed.
"""

from .interface import (
    _RANK_DEVICE,
    COMBINED,
    FUNCTIONS,
    GET_MODES,
    GET_OF,
    IUT_ATTR,
    LAYOUT_CAPABILITIES,
    LAYOUTS,
    MODES,
    OPTION_CAPABILITIES,
    OPTION_FIELDS,
    OPTIONS,
    PROFILES,
    Adapter,
    AdapterError,
    Needs,
    Unsupported,
    describe_declaration,
    fully_shard,
    iut_call,
    not_supported,
    raised_by_iut,
    rank_device,
    set_rank_device,
)
from .resolving import BUILTIN, _resolve, from_module, load_adapter

__all__ = [
    "BUILTIN",
    "COMBINED",
    "FUNCTIONS",
    "GET_MODES",
    "GET_OF",
    "IUT_ATTR",
    "LAYOUT_CAPABILITIES",
    "LAYOUTS",
    "MODES",
    "OPTIONS",
    "OPTION_CAPABILITIES",
    "OPTION_FIELDS",
    "PROFILES",
    "Adapter",
    "AdapterError",
    "Needs",
    "Unsupported",
    "_RANK_DEVICE",
    "_resolve",
    "describe_declaration",
    "from_module",
    "fully_shard",
    "iut_call",
    "load_adapter",
    "not_supported",
    "raised_by_iut",
    "rank_device",
    "set_rank_device",
]
