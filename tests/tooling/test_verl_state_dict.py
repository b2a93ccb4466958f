"""tools/releases/verl_state_dict.py: verl's vendored copy of torch's state_dict, loaded without the verl package."""

import importlib.util
import pickle
import sys
import textwrap

import pytest

from conformance import adapters
from tools.releases import verl_state_dict

UTILS = """
from dataclasses import dataclass


@dataclass
class _TensorInfo:
    size: tuple


def _gather_state_dict(state_dict):
    return dict(state_dict, gathered=True)
"""

STATE_DICT = """
from dataclasses import dataclass

from verl.third_party.torch.distributed._state_dict_utils import _gather_state_dict


@dataclass
class StateDictOptions:
    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False


def get_model_state_dict(model, *, submodules=None, options=None):
    return _gather_state_dict({"model": model})


def set_model_state_dict(model, model_state_dict, *, options=None):
    return None


def get_optimizer_state_dict(model, optimizers, *, submodules=None, options=None):
    return {}


def set_optimizer_state_dict(model, optimizers, optim_state_dict, *, options=None):
    return None
"""


@pytest.fixture
def clean_verl_modules():
    before = {k for k in sys.modules if k == "verl" or k.startswith("verl.")}
    yield
    for name in [k for k in sys.modules if (k == "verl" or k.startswith("verl.")) and k not in before]:
        del sys.modules[name]


def _fake_verl(root, *, with_copy=True):
    pkg = root / "verl"
    pkg.mkdir()
    # The real package imports ray and transformers here; the loader must never run it.
    (pkg / "__init__.py").write_text("raise ImportError('verl/__init__.py was executed')\n")
    info = root / "verl-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: verl\nVersion: 9.9.9\n")
    if with_copy:
        dist = pkg / "third_party" / "torch" / "distributed"
        (dist / "checkpoint").mkdir(parents=True)
        (dist / "_state_dict_utils.py").write_text(textwrap.dedent(UTILS))
        (dist / "checkpoint" / "state_dict.py").write_text(textwrap.dedent(STATE_DICT))
    return root


def test_the_copy_loads_under_its_dotted_names_without_the_verl_package(tmp_path, monkeypatch, clean_verl_modules):
    if "verl" in sys.modules:
        pytest.skip("the verl package is already imported in this process")
    monkeypatch.syspath_prepend(str(_fake_verl(tmp_path)))
    adapter = adapters._resolve("tools.releases.verl_state_dict")
    assert isinstance(adapter, adapters.Adapter)
    assert (adapter.name, adapter.version) == ("verl-vendored-torch-2.7", "9.9.9")
    assert adapter.profiles == frozenset({"multi-optimizer", "tp"}) and adapter.functions_are_iut
    module = sys.modules["verl.third_party.torch.distributed.checkpoint.state_dict"]
    assert module.__file__ == str(tmp_path / "verl/third_party/torch/distributed/checkpoint/state_dict.py")
    assert adapter.get_model_state_dict is module.get_model_state_dict
    # The copy's own import resolved to the vendored utilities; the parent packages are registered,
    # their code never run (the fake verl/__init__.py raises).
    assert adapter.get_model_state_dict("m") == {"model": "m", "gathered": True}
    assert sys.modules["verl"].__path__ == [str(tmp_path / "verl")]
    assert sys.modules["verl.third_party.torch.distributed"].checkpoint.state_dict is module
    # Broadcast loads pickle the copy's _TensorInfo: pickle imports its module by name, top package first.
    utils = sys.modules["verl.third_party.torch.distributed._state_dict_utils"]
    assert pickle.loads(pickle.dumps(utils._TensorInfo(size=(2, 3)))) == utils._TensorInfo(size=(2, 3))
    assert adapter.options(strict=False).strict is False
    # A second resolution (each rank resolves --impl again) reuses the loaded modules.
    assert verl_state_dict.load() is module


def test_without_verl_the_error_says_how_to_install_it(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "verl" else find_spec(name, *a))
    with pytest.raises(adapters.AdapterError, match=r"verl is not installed.*pip install --no-deps verl==0\.6\.0"):
        adapters._resolve("tools.releases.verl_state_dict")


def test_a_verl_without_the_copy_is_named(tmp_path, monkeypatch, clean_verl_modules):
    if "verl" in sys.modules:
        pytest.skip("the verl package is already imported in this process")
    monkeypatch.syspath_prepend(str(_fake_verl(tmp_path, with_copy=False)))
    with pytest.raises(adapters.AdapterError, match=r"no third_party/torch/distributed/.*verl==0\.6\.0"):
        verl_state_dict.conformance_adapter()
