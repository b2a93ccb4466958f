"""Modules and optimizers: their registries and hooks, FSDP2's among them, read in place."""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
from typing import Callable, NamedTuple

import torch

from ..blocks import blocks


def child_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    # ``named_children()`` yields a module registered under two names once;
    # canonical FQNs need every name, and a dict lookup per child.
    return module._modules


def own_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    # ``named_parameters(recurse=False, remove_duplicate=False)`` gives the
    # same entries through a generator per module; the index reads thousands.
    return module._parameters


def own_buffers(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor | None], set[str]]:
    """A module's own buffers, and the names of those not in its state dict."""
    # As own_parameters: ``named_buffers`` goes through a generator per module,
    # and tells nothing of persistence.
    return module._buffers, module._non_persistent_buffers_set


_FSDP_RESHARD_HOOK = "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"


@contextlib.contextmanager
def fsdp2_reshard_hooks_off(model: torch.nn.Module):
    """``model.state_dict()`` without FSDP2's pre-hook, which reshards the
    modules a forward left unsharded: a get reads the sharded parameters from
    FSDP2's groups instead and leaves the modules as it found them."""
    # The hook registries are private to nn.Module; the hooks are put back in
    # their order.
    saved = []
    for module in model.modules():
        hooks = module._state_dict_pre_hooks
        if any(getattr(h, "__qualname__", None) == _FSDP_RESHARD_HOOK for h in hooks.values()):
            saved.append((hooks, list(hooks.items())))
            for key in [k for k, h in hooks.items() if getattr(h, "__qualname__", None) == _FSDP_RESHARD_HOOK]:
                del hooks[key]
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)


@functools.cache
def fsdp2_class() -> type:
    # Imported once: the index asks every module of a large model.
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


_MODULE_INFO, _SHARDED_PARAM = operator.attrgetter("_module_info"), operator.attrgetter("sharded_param")
_INFO_PARAMETERS, _INFO_NAME = operator.attrgetter("module._parameters"), operator.attrgetter("param_name")
_INFO_SHARED = operator.attrgetter("shared_modules")


def _fsdp2_groups(module: torch.nn.Module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # a list in newer torch, one group before
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


def fsdp2_resharded(module: torch.nn.Module) -> bool:
    """Whether every parameter group of FSDP2's unit ``module`` says it is
    sharded (each of its modules holds the sharded parameters FSDP2 registered):
    asked of the groups' state, without reading every parameter."""
    # FSDPParamGroup.is_sharded is public on a private class.
    return all(getattr(group, "is_sharded", False) for group in _fsdp2_groups(module))


def fsdp2_sharded_params(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
    """(module, attribute name, sharded parameter) for each parameter that
    ``module``'s FSDP2 state manages and that is registered as something else
    now: the unsharded parameter after a forward that left it unsharded
    (``reshard_after_forward=False`` or an int, an explicit ``unshard()``).

    The optimizer steps the sharded parameters wherever the module's
    attributes point; FSDP2 says where they are only through its parameter
    groups (``state_dict()``'s pre-hook finds them by resharding, which a get
    must not do)."""
    if not isinstance(module, fsdp2_class()):
        return []
    groups = _fsdp2_groups(module)
    found = []
    for group in groups:
        fsdp_params = group.fsdp_params
        infos = list(map(_MODULE_INFO, fsdp_params))
        registered = map(dict.get, map(_INFO_PARAMETERS, infos), map(_INFO_NAME, infos))
        if all(map(operator.is_, registered, map(_SHARDED_PARAM, fsdp_params))) and not any(
            map(len, map(_INFO_SHARED, infos))
        ):
            continue  # (every parameter registered sharded, none shared: a column at a time, in C)
        for fsdp_param in fsdp_params:
            info, sharded = fsdp_param._module_info, fsdp_param.sharded_param
            if info.module._parameters.get(info.param_name) is not sharded:
                found.append((info.module, info.param_name, sharded))
            for owner, name in zip(info.shared_modules, info.shared_param_names):
                if owner._parameters.get(name) is not sharded:
                    found.append((owner, name, sharded))
    return found


def _class_reads_plainly(cls: type) -> bool:
    return (
        cls.state_dict is torch.nn.Module.state_dict
        and cls._save_to_state_dict is torch.nn.Module._save_to_state_dict
        and cls.get_extra_state is torch.nn.Module.get_extra_state
    )


_STATE_DICT_HOOKS = operator.attrgetter("_state_dict_hooks")
_STATE_DICT_PRE_HOOKS = operator.attrgetter("_state_dict_pre_hooks")


def all_read_plainly(modules: list[torch.nn.Module]) -> bool:
    """Whether each of ``modules``' own state dict is its parameters and
    buffers as registered, so that it may be read from them straight: no
    ``state_dict``, ``_save_to_state_dict`` or ``get_extra_state`` of its
    class's or its own (torch calls a method patched on the instance, and
    ``get_extra_state`` only where the class overrides it), no state-dict
    hook but FSDP2's, which reshards the module's group."""
    # ``model.state_dict()`` is a recursive call, a hook loop and a dict per
    # module: a fifth of a sharded get on a model of small layers. Hook
    # registries and the extra-state protocol are private to nn.Module. Each
    # class is asked on every call (a class may be patched between calls),
    # each module's registries and attributes a column at a time, in C (in blocks: see hyperdsd.blocks).
    qualnames: set = set()
    for some in map(modules.__getitem__, blocks(len(modules))):
        own = list(map(vars, some))  # (a state_dict or _save_to_state_dict patched on the module itself)
        if (
            not all(map(_class_reads_plainly, set(map(type, some))))
            or any(map(len, map(_STATE_DICT_HOOKS, some)))
            or any(map(operator.contains, own, itertools.repeat("state_dict")))
            or any(map(operator.contains, own, itertools.repeat("_save_to_state_dict")))
        ):
            return False
        qualnames |= _qualnames(map(_STATE_DICT_PRE_HOOKS, some))
    return qualnames <= {_FSDP_RESHARD_HOOK}


def _qualnames(registries) -> set:
    """The ``__qualname__`` of every hook in ``registries`` (hook dicts), read
    in C; most registries are empty, and are passed over without a view of each."""
    hooks = itertools.chain.from_iterable(map(dict.values, filter(None, registries)))
    return set(map(getattr, hooks, itertools.repeat("__qualname__"), itertools.repeat(None)))


def has_extra_state(module: torch.nn.Module) -> bool:
    """Whether ``module``'s class keeps extra state (nn.Module's protocol:
    ``state_dict`` calls ``get_extra_state`` only where a class overrides it)."""
    return type(module).get_extra_state is not torch.nn.Module.get_extra_state


# FSDP2's load hooks: before, the module's group resharded (as before a read);
# after, each sharded parameter re-padded if loading replaced its local tensor.
_FSDP_LOAD_HOOKS = (_FSDP_RESHARD_HOOK, "FSDPParam.__init__.<locals>.<lambda>")


def loads_plainly(module: torch.nn.Module) -> bool:
    """Whether ``load_state_dict`` would do no more for ``module``'s own
    parameters and buffers than copy each value into its tensor, so that a
    value of the tensor's layout and dtype may be copied in directly."""
    # ``model.load_state_dict`` hands each child the entries under its prefix,
    # filtered from its parent's: every key is tested once per sibling of each
    # module above it, thousands of times on a module with thousands of
    # children. Load hooks and ``_load_from_state_dict`` are private to
    # nn.Module. FSDP2's hooks do nothing to a copy made in place into the
    # sharded parameter (the plan reads the model resharded, and the local
    # tensor is kept).
    if (
        type(module)._load_from_state_dict is not torch.nn.Module._load_from_state_dict
        or "_load_from_state_dict" in module.__dict__  # patched on the instance
    ):
        return False
    for hooks in (module._load_state_dict_pre_hooks, module._load_state_dict_post_hooks):
        for hook in hooks.values():
            if getattr(hook, "__qualname__", None) not in _FSDP_LOAD_HOOKS:
                return False
    return True


_LOAD_PRE_HOOKS = operator.attrgetter("_load_state_dict_pre_hooks")
_LOAD_POST_HOOKS = operator.attrgetter("_load_state_dict_post_hooks")


class LoadHookNames(NamedTuple):
    """``modules``' load-hook registries, read once for both questions below."""

    pre: list[dict]  # each module's load pre-hooks
    post: list[dict]  # and post-hooks
    names: set  # the ``__qualname__`` of every pre-hook and of every post-hook
    post_names: set  # of every post-hook


def load_hook_names(modules: list[torch.nn.Module]) -> LoadHookNames:
    pre, post = list(map(_LOAD_PRE_HOOKS, modules)), list(map(_LOAD_POST_HOOKS, modules))
    post_names = _qualnames(post)
    return LoadHookNames(pre, post, _qualnames(pre) | post_names, post_names)


def load_post_hooked(hooks: LoadHookNames) -> bool:
    """Whether any of the modules ``hooks`` were read from has a load post-hook
    but FSDP2's: each is handed the missing and unexpected keys of the whole
    load, which a load of part of the values through ``load_state_dict`` would
    get wrong."""
    return not hooks.post_names <= set(_FSDP_LOAD_HOOKS)


def each_loads_plainly(modules: list[torch.nn.Module], hooks: LoadHookNames) -> list[bool]:
    """:func:`loads_plainly` of each of ``modules`` (their hooks ``hooks``): its
    class asked once, and only a module with load hooks or a patched method
    one by one."""
    plain_class = {
        cls: cls._load_from_state_dict is torch.nn.Module._load_from_state_dict for cls in set(map(type, modules))
    }
    plain = list(map(plain_class.__getitem__, map(type, modules)))
    pre, post = hooks.pre, hooks.post
    asked = list(map(operator.contains, map(vars, modules), itertools.repeat("_load_from_state_dict")))  # patched
    if not hooks.names <= set(_FSDP_LOAD_HOOKS):  # hooks of others' somewhere
        asked = list(map(operator.or_, asked, map(operator.or_, map(bool, pre), map(bool, post))))
    for i in itertools.compress(range(len(modules)), asked):
        plain[i] = plain[i] and loads_plainly(modules[i])
    return plain


def filled_in_batch_counts(modules: list[torch.nn.Module], prefixes: list[str], state_dict: dict) -> set[int]:
    """The ids of the ``num_batches_tracked`` buffers of ``modules`` (their
    key prefixes ``prefixes``) that their own loading fills in where
    ``state_dict`` lacks them: a batch norm's that tracks running stats does
    when the dict carries no version under the module's own path, or one
    before 2 (saved before the buffer existed), and loads its value again."""
    # _NormBase._load_from_state_dict; the class and the state dict's _metadata
    # are private. The buffer finds its module: a wrapper (activation
    # checkpointing's) may leave the module's own path out of the keys.
    metadata = getattr(state_dict, "_metadata", None)
    filled = set()
    for module, prefix in zip(modules, prefixes):
        if isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats:
            count = module._buffers.get("num_batches_tracked")
            version = metadata.get(prefix[:-1], {}).get("version") if metadata is not None else None
            if count is not None and (version is None or version < 2):
                filled.add(id(count))
    return filled


def loads_by_copying(model: torch.nn.Module) -> bool:
    """Whether ``model.load_state_dict`` itself, not overridden, copies values
    into the tensors (swapping tensors, when torch is told to, runs each
    parameter's own ``module_load``)."""
    return (
        type(model).load_state_dict is torch.nn.Module.load_state_dict
        and "load_state_dict" not in model.__dict__
        and not torch.__future__.get_swap_module_params_on_conversion()
    )


def plain_state_dict(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.state_dict()`` would only repackage ``opt.state`` and
    ``opt.param_groups`` (not overridden by its class or patched on it, no
    state-dict hooks registered)."""
    # Then the state is read in place: state_dict()'s packing (a dict by
    # integer id, a copy of every group) is a tenth of a get on a model of
    # small tensors. Registration of the hooks is public, the registry not.
    return (
        getattr(type(opt), "state_dict", None) is torch.optim.Optimizer.state_dict
        and "state_dict" not in vars(opt)
        and not getattr(opt, "_optimizer_state_dict_pre_hooks", None)
        and not getattr(opt, "_optimizer_state_dict_post_hooks", None)
    )


class LoadHooks(NamedTuple):
    pre: list[Callable]
    post: list[Callable]


def optimizer_load_hooks(opt: torch.optim.Optimizer) -> LoadHooks:
    # Optimizer.load_state_dict replays these; loading in place means we
    # replay them ourselves (registration is public, the registry is not).
    pre = list(getattr(opt, "_optimizer_load_state_dict_pre_hooks", {}).values())
    post = list(getattr(opt, "_optimizer_load_state_dict_post_hooks", {}).values())
    return LoadHooks(pre, post)


def unhooked_step(opt_class: type) -> Callable:
    # Optimizer patches ``step`` at class level with a wrapper that runs the
    # instance's and the global step hooks; a scratch step must not run them.
    step = opt_class.step
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        return step.__wrapped__
    return step


def is_compiled_module(module: torch.nn.Module) -> bool:
    # Checked by name: importing torch._dynamo costs a second of start-up.
    return type(module).__name__ == "OptimizedModule" and "_orig_mod" in module._modules


def incompatible_keys(missing: list[str], unexpected: list[str]):
    # What Module.load_state_dict returns; set_model_state_dict returns the same type.
    from torch.nn.modules.module import _IncompatibleKeys

    return _IncompatibleKeys(missing, unexpected)


def checkpoint_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    # Activation checkpointing's wrapper module, whose child name
    # (_checkpoint_wrapped_module) state dicts must hide; torch keeps it in a
    # private module path. The suite wraps models with it.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module)
