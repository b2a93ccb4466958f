"""FSDP1 as a wrapper layout (:mod:`hyperdsd.wrappers`): its modules are
``FullyShardedDataParallel`` instances, the child each wraps is hidden from
FQNs, its flat parameters are its own, and a call works on the model's
twin (:mod:`.twin`), a full get gathering from the flat shards
(:mod:`.streaming`), a load landed and written back into them (:mod:`.load`)."""

from __future__ import annotations

from .. import _compat, wrappers


class FSDP1Layout(wrappers.WrapperLayout):
    name = "FSDP1"

    @property
    def module_class(self) -> type:
        return _compat.fsdp1_class()

    def hidden_children(self, module) -> set[str]:
        if _compat.FSDP1_WRAPPED in _compat.child_modules(module) and _compat.is_fsdp1(module):
            return {_compat.FSDP1_WRAPPED}
        return set()

    def is_own(self, param) -> bool:
        return _compat.is_flat_param(param)

    def twin(
        self, model, index, optims: tuple, modifiers_attr: str, *, to_load: frozenset[str], full: bool
    ) -> wrappers.Twin:
        # (loaded for FSDP1 models only)
        from .load import FSDP1Load
        from .streaming import model_rounds, optim_rounds
        from .twin import FSDP1Twin

        twin = FSDP1Twin(model, index, optims, modifiers_attr, to_load=to_load, stream=full and not to_load)
        return wrappers.Twin(
            twin.model,
            twin.optims,
            twin.index,
            model_rounds(twin),
            optim_rounds(twin),
            FSDP1Load(twin) if to_load else None,
            twin.release,
        )
