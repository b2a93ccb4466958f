"""The matrix as data: the catalog's picks, the grid that expands a clause's
matrix, and the fence that keeps layout names out of the sections."""

import ast
import glob
import os

import pytest

from conformance import modes
from conformance.running.cases import grid
from conformance.world import catalog
from conformance.world.catalog import CATALOG, CATALOG_NAMES, Pick, moves, pick, traits
from conformance.world.layouts import parse_layout

SECTIONS = os.path.join(os.path.dirname(__file__), "..", "..", "conformance", "sections")
# The picks of more than one layout: FSDP1's families and the shared unions.
UNIONS = ("FSDP1", "FSDP1_ORIGINAL", "BASE", "ENDS", "DATA_PARALLEL", "SHARDED", "FSDP1_FULL_SHARD")
ATOMS = {name: value for name, value in vars(catalog).items() if isinstance(value, Pick) and name not in UNIONS}


def test_every_catalog_layout_is_one_atom_and_says_what_it_exercises():
    """Each layout the matrix runs on is picked by its traits into exactly one
    atom: a trait renamed or mistyped would leave a layout out of every
    clause, or in two atoms at once."""
    holders = {layout: [a for a, p in ATOMS.items() if layout in p] for layout in CATALOG}
    assert all(len(p) == 1 for p in ATOMS.values()), {a: list(p) for a, p in ATOMS.items()}
    assert {layout: len(h) for layout, h in holders.items()} == dict.fromkeys(CATALOG, 1), holders
    assert set(catalog.FSDP1) == {lay for lay in CATALOG if lay.wrapper == "fsdp1"}
    assert [lay.name for lay in CATALOG] == list(CATALOG_NAMES)


def _names(pick) -> tuple:
    return tuple(lay.name for lay in pick)


def test_picks_keep_the_catalog_order_whatever_the_operands_order():
    union = catalog.SHARDED_STAGES | catalog.ONE_RANK | catalog.QUARTERS
    assert _names(union) == ("single", "fsdp4", "pp2xfsdp2")
    assert isinstance(union, Pick)
    assert _names(catalog.BASE - catalog.SHARDED) == ("single", "ddp", "pp2")
    assert _names(catalog.SHARDED & catalog.ENDS) == ("fsdp4",)
    assert catalog.BASE + ("fsdp1-2",) == tuple(catalog.BASE) + ("fsdp1-2",)  # still a tuple


def test_pick_by_traits_and_its_errors():
    assert _names(pick(pp=2)) == ("pp2", "pp2xfsdp2")
    assert _names(pick(wrapper="fsdp1", flat_params=True)) == ("fsdp1-4-flat",)
    assert _names(pick(shard_degree=(3, 4), wrapper="fsdp2")) == ("fsdp3", "fsdp4")
    assert traits(parse_layout("hsdp2x2"))["shard_degree"] == 2 and traits(parse_layout("pp2xfsdp2"))["mesh_dims"] == 2
    with pytest.raises(TypeError, match="no layout trait \\['stages'\\]"):
        pick(stages=2)
    with pytest.raises(ValueError, match="expected one layout"):
        catalog.ENDS.one()
    assert [m.name for m in moves((catalog.QUARTERS, catalog.HALVED))] == ["fsdp4_to_fsdp2"]


def _check(c, layout, opt, mode, flag=False):
    """A stand-in check: grid passes what the check's signature takes."""


def test_grid_expands_layouts_then_optimizers_then_modes_then_variants():
    cases = list(
        grid(
            "OPT-RT-1",
            catalog.ENDS,
            _check,
            opts=("adamw", "sgd"),
            modes=("sharded",),
            variants={None: {}, "on": {"flag": True}},
        )
    )
    assert [c.id for c in cases] == [
        "OPT-RT-1[single-adamw-sharded]",
        "OPT-RT-1[single-adamw-sharded-on]",
        "OPT-RT-1[single-sgd-sharded]",
        "OPT-RT-1[single-sgd-sharded-on]",
        "OPT-RT-1[fsdp4-adamw-sharded]",
        "OPT-RT-1[fsdp4-adamw-sharded-on]",
        "OPT-RT-1[fsdp4-sgd-sharded]",
        "OPT-RT-1[fsdp4-sgd-sharded-on]",
    ]
    # A case's function gets the layout and the mode as objects, made once where the matrix is expanded.
    assert cases[1].phases[0].params == {
        "layout": catalog.ONE_RANK.one(),
        "opt": "adamw",
        "mode": modes.SHARDED,
        "flag": True,
    }
    assert cases[1].layout is catalog.ONE_RANK.one() and cases[1].mode is modes.SHARDED
    assert cases[4].world_sizes == (4,)
    with pytest.raises(TypeError, match="modes takes a sequence"):
        list(grid("OPT-RT-1", catalog.ENDS, _check, modes="sharded"))


def _layout_literals(path: str, *, catalog_only: bool) -> list[tuple[int, str]]:
    """The string constants in ``path`` that name a layout (one the catalog
    holds, with ``catalog_only``); a wrapper's name compared with a layout's
    ``wrapper`` ("fsdp2") is a trait, not a layout."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    traits_compared = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "wrapper" for s in sides):
                traits_compared |= {id(s) for s in sides}
        if isinstance(node, ast.keyword) and node.arg == "wrapper":
            traits_compared.add(id(node.value))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in traits_compared:
            try:
                lay = parse_layout(node.value)
            except ValueError:
                continue
            if not catalog_only or lay.base in CATALOG_NAMES:
                found.append((node.lineno, node.value))
    return found


def _sections() -> list[str]:
    return sorted(glob.glob(os.path.join(SECTIONS, "*.py")))


def test_sections_pick_catalog_layouts_by_what_they_are_not_by_name():
    """A clause's matrix picks the catalog's layouts (conformance.world.catalog);
    a name typed in a section would miss a layout added to the catalog."""
    typed = {os.path.basename(p): _layout_literals(p, catalog_only=True) for p in _sections()}
    typed = {module: found for module, found in typed.items() if found}
    assert not typed, f"catalog layouts named in sections: {typed}"


def test_sections_name_few_layouts_and_say_why():
    """Layouts outside the catalog are named where a clause is about that one
    layout (tensor parallelism, experts' meshes, a two-rank HSDP), each with a
    comment on its line or the lines just above saying why."""
    named = []
    for path in _sections():
        lines = open(path, encoding="utf-8").read().splitlines()
        for lineno, name in _layout_literals(path, catalog_only=False):
            context = lines[max(0, lineno - 4) : lineno]
            named.append((os.path.basename(path), lineno, name, any("#" in line for line in context)))
    assert len(named) <= 24, f"{len(named)} layout names in sections: {named}"
    assert all(has_reason for *_, has_reason in named), [n for n in named if not n[-1]]


def test_no_capability_is_read_from_a_layout_name():
    """What a layout is (pipeline, flat parameters, FSDP1, tensor parallel) is a
    field of its kind: no code tests a name for a fragment of one."""
    fragments = {"pp", "tp", "+", "halves", "fsdp1-", "-flat", "fsdp1", "hsdp", "ddp", "ep"}
    root = os.path.join(os.path.dirname(__file__), "..", "..", "conformance")
    offenders = []
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in ("startswith", "endswith") and any(
                    isinstance(a, ast.Constant) and a.value in fragments for a in node.args
                ):
                    offenders.append(f"{os.path.relpath(path, root)}:{node.lineno}")
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):
                if node.left.value in fragments and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                    offenders.append(f"{os.path.relpath(path, root)}:{node.lineno}")
    assert not offenders, offenders
