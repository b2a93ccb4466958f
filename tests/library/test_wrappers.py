"""The wrapper-layout seam (hyperdsd.wrappers): a layout registered there is
found by the index's walk, its modules listed, its hidden children and own
parameters left out of FQNs, and every call works on its twin; a load is
written back through the twin's load. One process, a toy layout."""

import pytest
import torch
import torch.nn as nn

import hyperdsd
from hyperdsd import StateDictError, wrappers
from hyperdsd.state.keys.fqn import ModelIndex


class Box(nn.Module):
    """A toy wrapper: its child under ``_boxed``, and a packed copy of the
    child's parameters (``_packed``) that stands for the wrapper's own layout."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self._boxed = inner
        self._packed = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in inner.parameters()]))
        self._packed.box_own = True


class OtherBox(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self._boxed = inner


class Repack:
    """The toy twin's load: the loaded child written back into ``_packed``."""

    def __init__(self, boxes):
        self.boxes = boxes
        self.written = 0

    def land(self, model_plan, optim_plan):
        pass

    def write_back(self, model_plan, optim_plan):
        for box in self.boxes:
            box._packed.data.copy_(torch.cat([p.detach().reshape(-1) for p in box._boxed.parameters()]))
        self.written += 1


class BoxLayout(wrappers.WrapperLayout):
    name = "box"
    cls = Box
    twins = []

    @property
    def module_class(self):
        return self.cls

    def hidden_children(self, module):
        return {"_boxed"} if type(module) is self.cls else set()

    def is_own(self, param):
        return getattr(param, "box_own", False)

    def twin(self, model, index, optims, modifiers_attr, *, to_load, full):
        self.twins.append((model, [m for m, _ in index.wrapped], to_load, full))
        load = Repack([m for m, _ in index.wrapped]) if to_load else None
        # The twin: the model with each box replaced by what it holds (the same parameters).
        plain = nn.Sequential(*(m._boxed if type(m) is self.cls else m for m in model))
        return wrappers.Twin(plain, optims, ModelIndex(plain, modifiers_attr), load=load)


class OtherLayout(BoxLayout):
    name = "other-box"
    cls = OtherBox


@pytest.fixture
def layouts(monkeypatch):
    monkeypatch.setattr(wrappers, "_LAYOUTS", list(wrappers.registered()))
    box, other = BoxLayout(), OtherLayout()
    box.twins, other.twins = [], []
    wrappers.register(box)
    wrappers.register(other)
    return box, other


def model(box=Box):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), box(nn.Linear(3, 2)))


def test_the_walk_lists_a_registered_layouts_modules_and_hides_what_it_hides(layouts):
    m = model()
    index = ModelIndex(m)
    assert index.wrapper is layouts[0]
    assert index.wrapped == [(m[1], "1.")]
    assert list(index.param_of) == ["0.weight", "0.bias", "1.weight", "1.bias"]  # no _boxed., no _packed
    assert id(m[1]._packed) not in set(map(id, index.params))
    assert ModelIndex(nn.Sequential(nn.Linear(3, 3))).wrapper is None


def test_a_model_without_a_registered_layout_is_its_own(layouts, monkeypatch):
    monkeypatch.setattr(wrappers, "_LAYOUTS", [])
    index = ModelIndex(model())
    assert index.wrapper is None and index.wrapped == []
    assert "1._boxed.weight" in index.param_of


def test_calls_work_on_the_twin_and_a_load_is_written_back(layouts):
    box, _ = layouts
    m = model()
    sd = hyperdsd.get_model_state_dict(m)
    assert list(sd) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert box.twins[-1][1:] == ([m[1]], frozenset(), False)  # a get's twin: nothing to load
    new = {k: torch.full_like(v, 2.0) for k, v in sd.items()}
    hyperdsd.set_model_state_dict(m, new)
    assert box.twins[-1][2] == {"model"}  # the load's twin, told what the load loads
    assert torch.equal(m[1]._packed.detach(), torch.full((8,), 2.0))  # written back through the twin's load
    assert torch.equal(m[1]._boxed.weight.detach(), torch.full((2, 3), 2.0))


def test_a_refused_load_writes_nothing_back(layouts):
    m = model()
    before = m[1]._packed.detach().clone()
    with pytest.raises(StateDictError, match="1.bias"):
        hyperdsd.set_model_state_dict(m, {"0.weight": torch.zeros(3, 3)})
    assert torch.equal(m[1]._packed.detach(), before)


def test_two_wrapper_layouts_in_one_model_are_refused_naming_both(layouts):
    m = nn.Sequential(Box(nn.Linear(3, 3)), OtherBox(nn.Linear(3, 2)))
    with pytest.raises(StateDictError, match=r"'1' is laid out by other-box and module '0' by box"):
        ModelIndex(m)
    with pytest.raises(StateDictError, match="other-box"):
        hyperdsd.get_model_state_dict(m)


def test_a_wrapped_models_index_is_kept_while_the_model_and_the_layouts_are_as_they_were(layouts):
    """The index is kept from one call to the next for a wrapped model too
    (its layout's modules by position), and built anew once the model's
    registries or the registered layouts change."""
    from test_index_cache import assert_same_index, of

    box, _ = layouts
    m = model()
    first, built = of(m)
    assert built == 1 and first.wrapped == [(m[1], "1.")] and first.wrapper is box
    kept, built = of(m)
    assert built == 0 and kept is not first
    assert_same_index(kept, m, ["nothing"])
    m[1]._packed = nn.Parameter(m[1]._packed.detach().clone())  # another own parameter: registries differ
    m[1]._packed.box_own = True
    again, built = of(m)
    assert built == 1 and id(m[1]._packed) not in set(map(id, again.params))
    wrappers.register(BoxLayout())  # the same name, another layout object: the walk would read it
    after, built = of(m)
    assert built == 1 and after.wrapper is not box
    assert_same_index(after, m, ["another layout registered"])
