"""Two fences, both checked by parsing the sources.

- Private torch APIs, and private names of the standard library (an
  attribute of one of its modules, or any private name fetched by string
  with getattr), live in one place per product, the package
  hyperdsd/_compat/ (and the harness's hyperdsd/testing/_compat.py) and
  conformance/_compat.py, each with its reason: a torch upgrade breaks
  private APIs first, and keeping them in one place keeps the fix there.
- The suite is independent of the library it judges: conformance/ uses
  hyperdsd only through its public API and the shared harness
  (hyperdsd.testing), so a bug in hyperdsd's helpers cannot be shared by the
  suite that certifies it.
"""

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
ALLOWED = {
    *(ROOT / "hyperdsd" / "_compat").glob("*.py"),
    ROOT / "hyperdsd" / "testing" / "_compat.py",
    ROOT / "conformance" / "_compat.py",
    ROOT / "conformance" / "examples" / "_compat.py",  # the worked examples' (stand-in stacks, vendors' adapters)
}
TORCH_NAMES = {"torch", "dist", "nn", "F"}  # how the sources name torch's modules
# Private attributes of torch objects (modules, tensors, optimizers, groups).
PRIVATE_ATTRS = {
    "_local_tensor",
    "_version",
    "_get_sequence_number_for_group",
    "_world",
    "_modules",
    "_parameters",
    "_buffers",
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
    "_EXTRA_STATE_KEY_SUFFIX",
    "_get_default_store",
    "_get_default_group",
}


# Names with a leading underscore that their module documents as public.
DOCUMENTED = {"_exit"}  # os._exit


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in DOCUMENTED


def _root(node: ast.AST) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


# The standard library's modules: their private names are as fragile as torch's.
STDLIB = frozenset(sys.stdlib_module_names)
# Names fetched by string: getattr(obj, "_name") hides a private use from the attribute check.
BY_NAME = {"getattr", "hasattr", "setattr", "delattr"}


def _stdlib_roots(tree: ast.AST) -> set[str]:
    """The names a source binds to standard-library modules (``import os``,
    ``from multiprocessing import forkserver``)."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in STDLIB}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in STDLIB and not node.level:
            roots |= {a.asname or a.name for a in node.names}
    return roots


def private_uses(source: str) -> list[tuple[int, str]]:
    found = []
    tree = ast.parse(source)
    stdlib = _stdlib_roots(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BY_NAME:
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                found.append((node.lineno, ast.unparse(node)))
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(_private(part) for part in node.module.split(".")) or any(_private(a.name) for a in node.names):
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and any(_private(p) for p in alias.name.split(".")):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr in PRIVATE_ATTRS or _root(node) in TORCH_NAMES or _root(node) in stdlib:
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_private_torch_apis_only_in_compat():
    offenders = []
    for folder in ("hyperdsd", "conformance", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path in ALLOWED:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in private_uses(path.read_text())]
    assert offenders == [], "private torch APIs outside the _compat modules:\n" + "\n".join(offenders)


def test_the_fence_sees_what_it_guards():
    caught = [
        "from torch.utils._pytree import tree_map",
        "import torch.distributed._functional_collectives",
        "from torch.nn.modules.module import _IncompatibleKeys",
        "groups = dist.distributed_c10d._world.pg_group_ranks",
        "local = t._local_tensor",
        "children = module._modules.items()",
        "pid = getattr(server, '_forkserver_pid', None)",
        "caching = getattr(self, '_enable_plan_caching', False)",
        "from multiprocessing import forkserver\nforkserver._forkserver",
    ]
    for sample in caught:
        assert private_uses(sample), sample
    allowed = [
        "from torch.distributed.tensor import DTensor, Shard",
        "from torch.distributed.fsdp import fully_shard as _fully_shard",
        "self._meshes[spec] = mesh",
        "version = getattr(module, '__version__', None)",
        "import os\nos.path.join('a', 'b')",
        "import os\nos._exit(1)",
    ]
    for sample in allowed:
        assert not private_uses(sample), sample


# -- the suite does not import the library it judges -----------------------------

HYPERDSD_PUBLIC = {"testing", *__import__("hyperdsd").__all__, "__version__"}


def hyperdsd_internals(source: str) -> list[tuple[int, str]]:
    """Uses of hyperdsd beyond its public names and the harness (hyperdsd.testing)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "hyperdsd":
            parts = node.module.split(".")
            names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            if any(name not in HYPERDSD_PUBLIC for name in names):
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "hyperdsd" and len(parts) > 1 and parts[1] not in HYPERDSD_PUBLIC:
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "hyperdsd":
            if node.attr not in HYPERDSD_PUBLIC and not node.attr.startswith("__"):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_suite_uses_only_hyperdsds_public_api_and_harness():
    offenders = []
    for path in sorted((ROOT / "conformance").rglob("*.py")):
        offenders += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in hyperdsd_internals(path.read_text())]
    assert offenders == [], "conformance/ uses hyperdsd internals:\n" + "\n".join(offenders)


def test_the_suite_fence_sees_what_it_guards():
    caught = [
        "from hyperdsd import tree",
        "from hyperdsd.placement import DTensorLayout",
        "import hyperdsd._compat",
        "index = hyperdsd.fqn.ModelIndex(model)",
        "from hyperdsd import get_state_dict, tree",
    ]
    for sample in caught:
        assert hyperdsd_internals(sample), sample
    allowed = [
        "import hyperdsd",
        "from hyperdsd import StateDictOptions, get_state_dict",
        "from hyperdsd.testing import PoolSet, Task",
        "from hyperdsd.testing.context import RankContext",
        "options = hyperdsd.StateDictOptions(full_state_dict=True)",
        "planner = hyperdsd.checkpoint.LoadPlanner()",
        "from . import tree",
    ]
    for sample in allowed:
        assert not hyperdsd_internals(sample), sample


# -- hyperdsd's layers -------------------------------------------------------------


def _imported_packages(path: pathlib.Path) -> set[str]:
    """The hyperdsd sub-packages (state, transport, ...) a module of hyperdsd/ imports from."""
    package = path.relative_to(ROOT / "hyperdsd").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - (node.level - 1)])
            parts = base + (node.module.split(".") if node.module else [])
            names = [parts] if node.module else [parts + [a.name] for a in node.names]
            found.update(p[0] for p in names if p)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hyperdsd."):
            found.add(node.module.split(".")[1])
    return found


def test_the_state_and_transport_layers_do_not_import_each_other():
    crossings = []
    for layer, other in (("state", "transport"), ("transport", "state")):
        for path in sorted((ROOT / "hyperdsd" / layer).rglob("*.py")):
            if other in _imported_packages(path):
                crossings.append(f"{path.relative_to(ROOT)} imports from hyperdsd.{other}")
    assert crossings == [], "\n".join(crossings)
    assert "state" in _imported_packages(ROOT / "hyperdsd" / "agreement.py")  # the check sees imports at all
    assert "transport" in _imported_packages(ROOT / "hyperdsd" / "agreement.py")


def test_a_rank_judging_torch_loads_no_hyperdsd_code():
    """The harness ships with hyperdsd but loads none of it: a bug in hyperdsd cannot change a verdict on torch."""
    import rank_modules

    from hyperdsd.testing import PoolSet, Task

    pools = PoolSet()
    try:
        outcome = pools.run(1, Task(rank_modules.hyperdsd_modules_after_a_torch_case, {}), 120)
    finally:
        pools.kill()
    assert outcome.status == "passed", outcome.describe()
    (loaded,) = outcome.values
    assert [m for m in loaded if m != "hyperdsd" and not m.startswith("hyperdsd.testing")] == [], loaded


# -- sizes: a module that grows past the cap becomes a folder ---------------------

MODULE_LINES = 400
FUNCTION_LINES = 80


def test_no_module_or_function_outgrows_its_cap():
    """hyperdsd and the suite alike (examples included: a vendor reads them)."""
    too_long = []
    for path in sorted([*(ROOT / "hyperdsd").rglob("*.py"), *(ROOT / "conformance").rglob("*.py")]):
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MODULE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}, {length} lines")
    assert not too_long, f"over {MODULE_LINES} lines a module, {FUNCTION_LINES} a function:\n" + "\n".join(too_long)


# -- names: one class name, one thing ----------------------------------------------


def class_definitions(sources: dict[str, str]) -> dict[str, list[str]]:
    """Each class name defined in ``sources`` (path -> source), at any depth -> ``path:line`` of each definition."""
    found: dict[str, list[str]] = {}
    for path, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(f"{path}:{node.lineno}")
    return found


def defined_twice(found: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: places for name, places in found.items() if len(places) > 1}


def test_no_class_name_is_defined_twice_in_hyperdsd():
    """One name per thing: two classes of one name (a Protocol and an unrelated class, say) are read, and
    searched for, as one."""
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "hyperdsd").rglob("*.py"))}
    found = class_definitions(sources)
    doubled = [f"{name}: {', '.join(places)}" for name, places in sorted(defined_twice(found).items())]
    assert doubled == [], "class names defined more than once in hyperdsd/:\n" + "\n".join(doubled)
    assert {"Twin", "TwinLoad", "FSDP1Twin", "FSDP1Load"} <= set(found)  # (the check reads what it should)


def test_the_class_name_fence_sees_what_it_guards():
    sources = {
        "a.py": "class Twin:\n    pass\n\n\nclass Load: ...\n",
        "b.py": "def make():\n    class Twin(Protocol): ...\n",  # (nested: still a second Twin)
        "c.py": "class Other: ...\n\n\nTwin = Other\nLoad = 1\n",  # (names bound otherwise: not classes)
    }
    assert defined_twice(class_definitions(sources)) == {"Twin": ["a.py:1", "b.py:2"]}


# -- wrapper layouts: FSDP1 is hyperdsd/fsdp1/'s ------------------------------------

FSDP1_NAMES = ("fsdp1", "fullyshardeddataparallel")
FSDP1_PLACES = {"fsdp1", "_compat"}  # the package, and its torch shims
FSDP1_REGISTRY = ROOT / "hyperdsd" / "api.py"  # registers the layout (hyperdsd.wrappers)


def _names_fsdp1(path: pathlib.Path) -> list[int]:
    return [n for n, line in enumerate(path.read_text().splitlines(), 1) if any(w in line.lower() for w in FSDP1_NAMES)]


def test_fsdp1_is_named_only_in_its_package_its_shims_and_where_it_is_registered():
    """A wrapper layout plugs in through hyperdsd.wrappers: the rest of the library knows no layout by name."""
    named = []
    for path in sorted((ROOT / "hyperdsd").rglob("*.py")):
        place = path.relative_to(ROOT / "hyperdsd").parts[0]
        if place in FSDP1_PLACES or path == FSDP1_REGISTRY:
            continue
        named += [f"{path.relative_to(ROOT)}:{n}" for n in _names_fsdp1(path)]
    assert named == [], "FSDP1 named outside hyperdsd/fsdp1/:\n" + "\n".join(named)
    registry = FSDP1_REGISTRY.read_text()
    assert len(_names_fsdp1(FSDP1_REGISTRY)) == 2 and "wrappers.register(FSDP1Layout())" in registry
    assert _names_fsdp1(ROOT / "hyperdsd" / "fsdp1" / "twin.py")  # (the check reads what it should)


# -- distributed values: the suite knows torch's DTensor in one place (SPEC 1.6) -----

PROTOCOL = ROOT / "conformance" / "tensors.py"
IMPLEMENTATIONS = ROOT / "conformance" / "examples"  # stand-in stacks: implementations, not the suite


def dtensor_uses(source: str) -> list[tuple[int, str]]:
    """Where a source names torch's DTensor class: imports it, or reads it as an attribute."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and any(a.name == "DTensor" for a in node.names):
            found.append((node.lineno, f"from {node.module} import DTensor"))
        elif isinstance(node, ast.Attribute) and node.attr == "DTensor":
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_suite_reads_distributed_values_only_through_its_protocol():
    """A distributed value is judged by what it holds, whatever its class: every oracle, snapshot, message
    and mode asks conformance.tensors, and only that module knows torch's DTensor."""
    offenders = []
    for path in sorted((ROOT / "conformance").rglob("*.py")):
        if path == PROTOCOL or IMPLEMENTATIONS in path.parents:
            continue
        offenders += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in dtensor_uses(path.read_text())]
    assert offenders == [], "torch's DTensor named outside conformance/tensors.py:\n" + "\n".join(offenders)
    assert dtensor_uses(PROTOCOL.read_text())  # the check reads what it should


def test_the_protocol_fence_sees_what_it_guards():
    caught = [
        "from torch.distributed.tensor import DTensor, Shard",
        "from torch.distributed.tensor import Shard, DTensor as DT",
        "ok = isinstance(v, torch.distributed.tensor.DTensor)",
    ]
    for sample in caught:
        assert dtensor_uses(sample), sample
    allowed = [
        "from torch.distributed.tensor import Shard, Replicate",
        "if tensors.is_distributed(v): pass",
        '"""a DTensor in a docstring"""',
    ]
    for sample in allowed:
        assert not dtensor_uses(sample), sample


# -- the suite's cases are typed values; sections are written with the kit ----------------------------

SECTIONS = ROOT / "conformance" / "sections"
MODE_TABLE = ROOT / "conformance" / "modes.py"
MODE_NAMES = {"sharded", "full", "full_cpu", "bcast", "file", "flat", "dcp", "flat_dcp"}


def section_imports(source: str) -> list[tuple[int, str]]:
    """Where a section imports another section (``from .x``, ``from ..sections``, ``conformance.sections``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1 or (node.level == 2 and module.startswith("sections")):
                found.append((node.lineno, f"from {'.' * node.level}{module} import ..."))
            elif node.level == 0 and module.startswith("conformance.sections"):
                found.append((node.lineno, f"from {module} import ..."))
    return found


def test_no_section_imports_another():
    """What two sections share lives in conformance/kit/ (or below it), so that a clause is one module's."""
    found = []
    for path in sorted(SECTIONS.glob("*.py")):
        found += [f"{path.name}:{line}: {what}" for line, what in section_imports(path.read_text())]
    assert found == [], "sections importing sections:\n" + "\n".join(found)
    assert section_imports("from .reshard import resharded_case") and section_imports("from . import keys")
    assert not section_imports("from ..kit import Setup, grid")


def mode_names_compared(source: str) -> list[tuple[int, str]]:
    """Comparisons of something with a mode's name (``mode == "dcp"``, ``x in ("full_cpu", "bcast")``)."""

    def names(node) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [v for e in node.elts for v in names(e)]
        return []

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and MODE_NAMES & {v for s in (node.left, *node.comparators) for v in names(s)}:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_modes_are_asked_what_they_are_never_named():
    """The rules of a mode live in its kind (conformance/modes.py): the suite asks ``mode.on_root``,
    ``mode.through_dcp``; only the table compares names."""
    found = []
    for path in sorted((ROOT / "conformance").rglob("*.py")):
        if path == MODE_TABLE or IMPLEMENTATIONS in path.parents:
            continue
        found += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in mode_names_compared(path.read_text())]
    assert found == [], "modes compared by name outside conformance/modes.py:\n" + "\n".join(found)
    assert len(mode_names_compared(MODE_TABLE.read_text())) <= 5
    assert mode_names_compared('ok = mode in ("full_cpu", "bcast")') and mode_names_compared('if m == "dcp": pass')
    assert not mode_names_compared("if mode.through_dcp: pass") and not mode_names_compared('k == "exp_avg"')


def test_layout_names_are_parsed_where_they_come_in():
    """A case holds its layout (or its move between two) as an object, made once where the matrix is expanded:
    the catalog, a case declared by a name, a scenario's record, a setup built by name (tests)."""
    sites = []
    for path in sorted((ROOT / "conformance").rglob("*.py")):
        if IMPLEMENTATIONS in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id == "parse_layout" and isinstance(node.ctx, ast.Load):
                sites.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "_to_" for a in node.args):
                sites.append(f"{path.relative_to(ROOT)}:{node.lineno}: a move's name split")
    assert len(sites) <= 4, "layout names parsed downstream:\n" + "\n".join(sites)
