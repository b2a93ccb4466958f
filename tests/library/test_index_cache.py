"""The model index kept from one call to the next (hyperdsd.state.keys.index_cache):
``ModelIndex.of`` gives what a fresh ``ModelIndex`` would, whatever changed
in between, builds nothing when nothing did, and holds neither the model nor
any tensor (one process, plain modules)."""

import functools
import gc
import itertools
import weakref
from unittest import mock

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hyperdsd
import hyperdsd.blocks
from hyperdsd import _compat
from hyperdsd._compat import checkpoint_wrapper
from hyperdsd.state.keys.fqn import ModelIndex
from hyperdsd.state.keys.index_cache import cached_models


@functools.cache
def hiding(base):
    """``base`` with ``_fqn_modifiers``: hides the child named by ``_hide``."""

    def _fqn_modifiers(self):
        hide = self.__dict__.get("_hide")
        return {"hidden": hide} if hide is not None else {}

    return type(f"Hiding{base.__name__}", (base,), {"_fqn_modifiers": _fqn_modifiers, "_base": base})


def build(hide=False):
    """Nested containers of Linear(2, 2), a weight tied across them, a
    persistent buffer on the root and a non-persistent one below; with
    ``hide``, a container whose ``_fqn_modifiers`` hides its first child."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(2, 2),
        nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))}),
    )
    model[1]["b"][1].weight = model[0].weight
    model.register_buffer("scale", torch.ones(2))
    model[1].register_buffer("cache", torch.zeros(2), persistent=False)
    if hide:
        model[1]["b"]._hide = "0"
        model[1]["b"].__class__ = hiding(nn.Sequential)
    return model


def of(model, modifiers_attr="_fqn_modifiers"):
    """``ModelIndex.of(model)``, and how many indexes it built (0: the kept one)."""
    built = [0]
    original = ModelIndex.__init__

    def counting(self, *args, **kwargs):
        built[0] += 1
        original(self, *args, **kwargs)

    with mock.patch.object(ModelIndex, "__init__", counting):
        index = ModelIndex.of(model, modifiers_attr)
    return index, built[0]


def fields(index):
    """Everything an index holds, objects by id."""
    return {
        "modules": [(id(m), canon) for m, canon in index.modules],
        "module_objects": list(map(id, index.module_objects)),
        "module_prefixes": list(index.module_prefixes),
        "registered": (index.registered[0], list(map(id, index.registered[1]))),
        "raw_prefixes": list(index.raw_prefixes),
        "tensors": [id(t) for t in index.tensors],
        "tensor_keys": list(index.tensor_keys),
        "tensor_raw_keys": list(index.tensor_raw_keys),
        "params": [id(p) for p in index.params],
        "fqn_by_id": dict(index.fqn_by_id),
        "param_of": {k: id(v) for k, v in index.param_of.items()},
        "first_name": dict(index.first_name),
        "renames": index.renames,
        "module_paths": {path: (id(m), canon) for path, (m, canon) in index._module_paths.items()},
        "modifiers_attr": index.modifiers_attr,
        "unsharded": index.unsharded,
        "wrapped": list(index.wrapped),
        "wrapper": index.wrapper,
        "reads_plainly": index.reads_plainly,
    }


def assert_same_index(kept, model, history=()):
    fresh = ModelIndex(model)
    assert kept.model is model
    got, want = fields(kept), fields(fresh)
    for name in want:
        assert got[name] == want[name], f"{name} differs after {list(history)}"


# -- the property: after any change, the kept index is a fresh one -----------

_names = itertools.count()


def _new_name(prefix):
    return f"{prefix}{next(_names)}"


def _params(model):
    return [(m, n) for m in model.modules() for n, p in m._parameters.items() if p is not None]


def _param_names(model):
    return [(m, n) for m in model.modules() for n in m._parameters]


def _buffers(model):
    return [(m, n) for m in model.modules() for n in m._buffers]


def _children(model):
    return [(m, n, c) for m in model.modules() for n, c in m._modules.items() if c is not None]


def _pick(data, options):
    return data.draw(st.sampled_from(options)) if options else None


def replace_param(model, data):
    if hit := _pick(data, _params(model)):
        m, n = hit
        setattr(m, n, nn.Parameter(torch.randn_like(getattr(m, n))))


def param_to_none(model, data):
    if hit := _pick(data, _params(model)):
        hit[0].register_parameter(hit[1], None)


def new_param(model, data):
    _pick(data, list(model.modules())).register_parameter(_new_name("p"), nn.Parameter(torch.zeros(2, 2)))


def delete_param(model, data):
    if hit := _pick(data, _param_names(model)):
        delattr(*hit)


def tie(model, data):
    params = _params(model)
    if hit := _pick(data, params):
        m, n = hit
        shape = getattr(m, n).shape
        other = _pick(data, [(m2, n2) for m2, n2 in params if getattr(m2, n2).shape == shape])
        setattr(other[0], other[1], getattr(m, n))


def untie(model, data):
    names = {}
    for m in model.modules():
        for n, p in m._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append((m, n))
    if hit := _pick(data, [where for group in names.values() if len(group) > 1 for where in group]):
        m, n = hit
        setattr(m, n, nn.Parameter(getattr(m, n).detach().clone()))


def add_child(model, data):
    _pick(data, list(model.modules())).add_module(_new_name("c"), nn.Linear(2, 2))


def child_to_none(model, data):
    if hit := _pick(data, _children(model)):
        hit[0].register_module(hit[1], None)


def alias_child(model, data):
    """A module under a second name (where that makes no cycle)."""
    if hit := _pick(data, _children(model)):
        child = hit[2]
        inside = {id(m) for m in child.modules()}
        target = _pick(data, [m for m in model.modules() if id(m) not in inside])
        target.add_module(_new_name("alias"), child)


def delete_child(model, data):
    if hit := _pick(data, _children(model)):
        delattr(hit[0], hit[1])


def replace_child(model, data):
    if hit := _pick(data, _children(model)):
        setattr(hit[0], hit[1], nn.Sequential(nn.Linear(2, 2)))


def wrap_child(model, data):
    """Activation checkpointing's wrapper in place of a child."""
    if hit := _pick(data, _children(model)):
        setattr(hit[0], hit[1], checkpoint_wrapper(hit[2]))


def persistent_buffer(model, data):
    _pick(data, list(model.modules())).register_buffer(_new_name("b"), torch.zeros(2))


def non_persistent_buffer(model, data):
    _pick(data, list(model.modules())).register_buffer(_new_name("b"), torch.zeros(2), persistent=False)


def toggle_persistence(model, data):
    """The same tensor under the same name, its persistence the other way."""
    if hit := _pick(data, _buffers(model)):
        m, n = hit
        m.register_buffer(n, m._buffers[n], persistent=n in m._non_persistent_buffers_set)


def replace_buffer(model, data):
    if hit := _pick(data, _buffers(model)):
        setattr(hit[0], hit[1], torch.randn(2))


def buffer_to_none(model, data):
    if hit := _pick(data, _buffers(model)):
        setattr(hit[0], hit[1], None)


def reorder_params(model, data):
    """A parameter moved to the end of its module's registry."""
    if hit := _pick(data, _param_names(model)):
        m, n = hit
        m._parameters[n] = m._parameters.pop(n)


def move_across(model, data):
    """A module's last parameter or buffer moved, its name and persistence
    kept, to the front of the next module's registry: every name and object
    in the same order as before."""
    kind = data.draw(st.sampled_from(["_parameters", "_buffers"]))
    modules = list(model.modules())
    pairs = [
        (a, b)
        for a, b in zip(modules, modules[1:])
        if getattr(a, kind) and next(reversed(getattr(a, kind))) not in getattr(b, kind)
    ]
    if hit := _pick(data, pairs):
        _move_last_to_front(*hit, kind)


def _move_last_to_front(a, b, kind):
    name = next(reversed(getattr(a, kind)))
    value = getattr(a, kind).pop(name)
    rest = dict(getattr(b, kind))
    getattr(b, kind).clear()
    getattr(b, kind).update({name: value, **rest})
    if name in a._non_persistent_buffers_set:
        a._non_persistent_buffers_set.discard(name)
        b._non_persistent_buffers_set.add(name)


def hide_child(model, data):
    """The class changed to one whose ``_fqn_modifiers`` hides a child."""
    if module := _pick(data, [m for m in model.modules() if any(c is not None for c in m._modules.values())]):
        module._hide = _pick(data, [n for n, c in module._modules.items() if c is not None])
        if not hasattr(type(module), "_base"):
            module.__class__ = hiding(type(module))


def rehide(model, data):
    """Another child hidden (or none): no registry changes, only what ``_fqn_modifiers`` says."""
    if module := _pick(data, [m for m in model.modules() if hasattr(type(m), "_base")]):
        module._hide = _pick(data, [name for name in (None, *module._modules) if name != module.__dict__.get("_hide")])


def unhide(model, data):
    """The class changed back."""
    if module := _pick(data, [m for m in model.modules() if hasattr(type(m), "_base")]):
        module.__class__ = type(module)._base


def cast(model, data):
    model.double()


def noop(model, data):
    pass


MUTATIONS = [
    replace_param,
    param_to_none,
    new_param,
    delete_param,
    tie,
    untie,
    add_child,
    child_to_none,
    alias_child,
    delete_child,
    replace_child,
    wrap_child,
    persistent_buffer,
    non_persistent_buffer,
    toggle_persistence,
    replace_buffer,
    buffer_to_none,
    reorder_params,
    move_across,
    hide_child,
    rehide,
    unhide,
    cast,
    noop,
]


def _all_double(model):
    tensors = [t for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values())]
    return all(t is None or t.dtype == torch.float64 for t in tensors)


@settings(derandomize=True, max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_kept_index_is_a_fresh_one_after_any_change(data):
    # (the registries read in blocks of 1 to 3 of the model's 7 modules, or in one: see hyperdsd.blocks)
    with mock.patch.object(hyperdsd.blocks, "BLOCK", data.draw(st.sampled_from([1, 2, 3, 512]), label="block")):
        _kept_index_after_changes(data)


def _kept_index_after_changes(data):
    model = build(hide=data.draw(st.booleans(), label="hide"))
    kept, _ = of(model)
    assert_same_index(kept, model)
    history = []
    for mutation in data.draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=12), label="mutations"):
        unchanged = mutation is noop or (mutation is cast and _all_double(model))
        mutation(model, data)
        history.append(mutation.__name__)
        kept, built = of(model)
        assert_same_index(kept, model, history)
        if unchanged:
            assert built == 0, f"built anew after {history}"
        # Nothing changed since: the next call keeps it.
        again, built = of(model)
        assert built == 0, f"built anew twice after {history}"
        assert_same_index(again, model, history)


# -- a change is seen --------------------------------------------------------


def test_a_changed_model_is_indexed_anew():
    model = build()
    of(model)
    assert of(model)[1] == 0

    old = model[1]["a"].weight
    new = nn.Parameter(torch.randn(2, 2))
    model[1]["a"].weight = new
    index, built = of(model)
    assert built == 1
    assert index.param_of["1.a.weight"] is new and id(old) not in index.fqn_by_id
    assert_same_index(index, model)

    model[1]["b"].add_module("extra", nn.Linear(2, 2))
    index, built = of(model)
    assert built == 1
    assert "1.b.extra.weight" in index.tensor_keys and index.param_of["1.b.extra.bias"] is model[1]["b"].extra.bias
    assert index._module_paths["1.b.extra"][0] is model[1]["b"].extra

    # The same tensor, persistent now: keyed (and persistent no more: not).
    model[1].register_buffer("cache", model[1].cache, persistent=True)
    index, built = of(model)
    assert built == 1 and "1.cache" in index.tensor_keys
    assert index.tensors[index.tensor_keys.index("1.cache")] is model[1].cache
    model[1].register_buffer("cache", model[1].cache, persistent=False)
    index, built = of(model)
    assert built == 1 and "1.cache" not in index.tensor_keys

    # A class that hides a child: its names lose the segment.
    model[1]["b"]._hide = "extra"
    model[1]["b"].__class__ = hiding(nn.Sequential)
    index, built = of(model)
    assert built == 1 and index.renames
    assert "1.b.weight" in index.param_of and "1.b.extra.weight" not in index.param_of
    assert "1.b.extra.weight" in index.tensor_raw_keys
    assert of(model)[1] == 0

    # What it hides changes, no registry does.
    model[1]["b"]._hide = "0"
    index, built = of(model)
    assert built == 1 and "1.b.extra.weight" in index.param_of and "1.b.0.weight" not in index.param_of
    assert_same_index(index, model)

    model[1]["b"].__class__ = nn.Sequential
    index, built = of(model)
    assert built == 1 and not index.renames and "1.b.0.weight" in index.param_of
    assert_same_index(index, model)


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.x = nn.Parameter(torch.zeros(2))
        self.register_buffer("kept", torch.zeros(2))


def test_an_entry_moved_to_the_next_module_is_indexed_anew():
    """One module's last parameter, buffer or child made the next module's
    first, under the same name: the names and objects read in walk order are
    as before, the FQNs are not."""
    model = nn.Sequential(nn.Linear(2, 2), _Holder())
    model[0].register_buffer("scale", torch.ones(2))
    for kind, moved in (("_parameters", "1.bias"), ("_buffers", "1.scale")):
        of(model)
        _move_last_to_front(model[0], model[1], kind)
        index, built = of(model)
        assert built == 1 and moved in index.tensor_keys, kind
        assert_same_index(index, model)

    # root -> x -> y (a Linear) becomes root -> x, root -> y: the same modules in the same order
    root, box, leaf = nn.Module(), nn.Module(), nn.Linear(2, 2)
    root.x, box.y = box, leaf
    assert of(root)[0].tensor_keys == ["x.y.weight", "x.y.bias"]
    del box.y
    root.y = leaf
    index, built = of(root)
    assert built == 1 and index.tensor_keys == ["y.weight", "y.bias"]
    assert_same_index(index, root)


def test_another_modifiers_attr_is_indexed_anew():
    model = build(hide=True)
    plain, _ = of(model, "_no_such_modifiers")
    assert not plain.renames
    index, built = of(model)
    assert built == 1 and index.renames and index.modifiers_attr == "_fqn_modifiers"
    assert_same_index(index, model)


def test_a_class_given_fqn_modifiers_later_is_indexed_anew():
    class Box(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

    model = nn.Sequential(Box())
    of(model)
    Box._fqn_modifiers = lambda self: {"hidden": "inner"}
    index, _ = of(model)
    assert index.tensor_keys == ModelIndex(model).tensor_keys == ["0.weight", "0.bias"]


# -- what the cache holds ----------------------------------------------------


def _model_and_optimizer():
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():  # (a ModuleDict takes no input: gradients made up)
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad()
    return model, opt


def test_the_cache_lets_the_model_go():
    gc.collect()
    before = cached_models()
    model, opt = _model_and_optimizer()
    msd, osd = hyperdsd.get_state_dict(model, opt)
    hyperdsd.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    assert cached_models() == before + 1
    ref = weakref.ref(model)
    del model, opt, msd, osd
    gc.collect()
    assert ref() is None
    assert cached_models() == before


def test_no_tensor_is_weakly_referenced():
    model, opt = _model_and_optimizer()
    hyperdsd.get_state_dict(model, opt)
    param = model[1]["a"].weight
    before = id(param)
    torch.utils.swap_tensors(param, nn.Parameter(torch.zeros_like(param)))
    assert id(model[1]["a"].weight) == before and not model[1]["a"].weight.any()
    index, built = of(model)
    assert built == 0  # (the same objects: swap_tensors keeps them)
    assert_same_index(index, model)
    assert not index.param_of["1.a.weight"].any()


def test_an_index_is_a_new_object_each_call():
    model = build()
    first, _ = of(model)
    second, built = of(model)
    assert built == 0
    assert first is not second
    for name in ("param_of", "first_name", "_module_paths", "fqn_by_id", "tensors", "tensor_keys", "params"):
        assert getattr(first, name) is not getattr(second, name), name
    second.param_of.pop("0.weight")
    second.first_name.pop("0.weight")
    second._module_paths.pop("0")
    second.fqn_by_id.pop(id(model[0].weight))
    assert "0.weight" in first.param_of and "0.weight" in first.first_name and "0" in first._module_paths
    third, built = of(model)
    assert built == 0
    assert "0.weight" in third.param_of and "0.weight" in third.first_name and "0" in third._module_paths
    assert third.fqn_of(model[0].weight) == "0.weight"

    # A hook on a submodule is no registry change, but the state dict is read through it.
    assert third.reads_plainly
    handle = model[1]["a"].register_state_dict_post_hook(lambda module, state_dict, prefix, local_metadata: None)
    fourth, built = of(model)
    assert built == 0
    assert not fourth.reads_plainly
    handle.remove()
    fifth, built = of(model)
    assert built == 0 and fifth.reads_plainly


def _post_hook(module):
    module.register_state_dict_post_hook(lambda module, state_dict, prefix, local_metadata: None)


def _pre_hook(module):
    module.register_state_dict_pre_hook(lambda module, prefix, keep_vars: None)


def _own_state_dict(module):
    module.state_dict = lambda *args, **kwargs: {}


def _own_save(module):
    module._save_to_state_dict = lambda destination, prefix, keep_vars: None


def _extra_state(module):
    module.__class__ = type("Extra", (type(module),), {"get_extra_state": lambda self: 1})


@pytest.mark.parametrize("change", [_post_hook, _pre_hook, _own_state_dict, _own_save, _extra_state])
@pytest.mark.parametrize("block", [1, 2, 3, 512])
def test_a_module_read_otherwise_is_seen_in_any_block(change, block):
    # (the modules are asked a block at a time, see hyperdsd.blocks: the last module, in the last block)
    with mock.patch.object(hyperdsd.blocks, "BLOCK", block):
        model = build()
        modules = list(model.modules())
        assert _compat.all_read_plainly(modules)
        change(modules[-1])
        assert not _compat.all_read_plainly(modules), change.__name__
