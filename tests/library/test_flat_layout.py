"""Flattening and unflattening the flat optimizer layout: keys made a column
at a time, or copied from the last call's, and rows taken whole give what
writing or reading each key alone gives.

``unflatten`` reads a parameter's keys one by one once, then checks the rows
after it a column at a time and takes those that follow the same pattern.
The property test builds flat dicts from rows that follow a pattern, break
it, share values, repeat an FQN, or hold keys no row can hold, and compares
the result with a plain key-by-key reading.
"""

import itertools
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hyperdsd.blocks
from hyperdsd.state.keys import flat as flat_format
from hyperdsd.state.keys import flat_keys
from hyperdsd.state.keys.flat import GROUPS, STATE, split_fqn, unflatten

FQNS = ["a", "a.b", "b", "a.b.c", "c.0", "w"]
NAMES = ["step", "exp_avg", "lr", "b", "x[0]", "m.n", "", "0", "q\nr", "betas"]


def read_key_by_key(flat: dict, fqns) -> tuple[dict, dict, list, list]:
    """The layout's rule for each key on its own (flat.py's docstring); the
    last list holds the keys that clash with a value read before them."""
    state, fields, unknown, clashes, with_lists = {}, {}, [], [], set()
    for key, value in flat.items():
        if not isinstance(key, str):
            unknown.append(repr(key))
            continue
        head, _, rest = key.partition(".")
        split = split_fqn(rest, fqns) if head in (STATE, GROUPS) else None
        if split is None:
            unknown.append(key)
            continue
        fqn, tail = split
        if head == GROUPS:
            fields.setdefault(fqn, {})[tail] = value
            continue
        path = flat_format._path(tail)
        node = state.setdefault(fqn, {})
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        if not isinstance(node, dict) or path[-1] in node:
            clashes.append(key)
            continue
        node[path[-1]] = value
        if len(path) > len(tail.split(".")):
            with_lists.add(fqn)
    for fqn in with_lists:
        state[fqn] = flat_format._lists(state[fqn])
    return state, fields, unknown, clashes


_values = itertools.count(1000)


@st.composite
def flat_dicts(draw) -> dict:
    flat: dict = {}
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["rows", "rows", "key", "stranger"]))
        if kind == "stranger":
            flat[draw(st.sampled_from([7, ("state", "a"), "state", "other.a.x", "state.zz.q", "param_groups."]))] = 1
            continue
        head = draw(st.sampled_from([STATE, GROUPS]))
        if kind == "key":
            flat[f"{head}.{draw(st.sampled_from(FQNS))}.{draw(st.sampled_from(NAMES))}"] = next(_values)
            continue
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
        shared = [next(_values) for _ in names] if draw(st.booleans()) else None  # one group's own values
        for fqn in draw(st.lists(st.sampled_from(FQNS), max_size=8)):
            for j, name in enumerate(names):
                flat[f"{head}.{fqn}.{name}"] = shared[j] if shared else next(_values)
            if draw(st.integers(0, 5)) == 0:  # a row that breaks the pattern
                flat[f"{head}.{fqn}.{draw(st.sampled_from(NAMES))}"] = next(_values)
    return flat


@settings(max_examples=400, deadline=None)
@given(flat_dicts(), st.sets(st.sampled_from(FQNS), min_size=1))
def test_rows_taken_whole_read_as_each_key_alone(flat, fqns):
    *read, problems = unflatten(flat, fqns)
    *expected, clashes = read_key_by_key(flat, fqns)
    assert read == expected
    assert len(problems) == len(clashes) and all(p.startswith(f"{k!r}: ") for p, k in zip(problems, clashes))


def test_a_key_under_another_keys_value_is_a_problem_not_a_crash():
    state, _, _, problems = unflatten({"state.w.m": 1, "state.w.m.x": 2, "state.w.v.x": 3, "state.w.v": 4}, {"w"})
    assert state == {"w": {"m": 1, "v": {"x": 3}}}
    assert problems == [
        "'state.w.m.x': the state 'm' of 'w' is a value and nested state at once",
        "'state.w.v': the state 'v' of 'w' is a value and nested state at once",
    ]


def test_a_shared_dict_of_fields_is_copied_before_a_later_key_adds_to_it():
    flat = {f"param_groups.{f}.{k}": v for f in ("a", "b", "c") for k, v in (("lr", 0.1), ("eps", 1e-8))}
    flat["param_groups.b.extra"] = 5
    _, fields, _, _ = unflatten(flat, {"a", "b", "c"})
    assert fields == {
        "a": {"lr": 0.1, "eps": 1e-8},
        "b": {"lr": 0.1, "eps": 1e-8, "extra": 5},
        "c": {"lr": 0.1, "eps": 1e-8},
    }


def test_the_rows_of_a_get_are_taken_whole_not_key_by_key(monkeypatch):
    fqns = [f"layers.{i}.{w}" for i in range(500) for w in ("weight", "bias")]
    flat = {f"state.{f}.{k}": object() for f in fqns for k in ("step", "exp_avg", "exp_avg_sq")}
    lr = 0.1
    flat.update({f"param_groups.{f}.{k}": lr for f in fqns for k in ("lr", "betas", "eps")})
    taken_whole = []
    fill = flat_format._Unflattening._fill
    monkeypatch.setattr(
        flat_format._Unflattening,
        "_fill",
        lambda self, head, names, fqns, values: (taken_whole.append(len(fqns)), fill(self, head, names, fqns, values)),
    )
    read = unflatten(flat, set(fqns))
    assert sum(taken_whole) == 2 * (len(fqns) - 1)  # all but each block's first row
    assert len(taken_whole) <= 2 * 12  # in chunks that double
    assert read == read_key_by_key(flat, set(fqns))


@pytest.mark.parametrize("layout", ["nested-state", "names-alternate"])
def test_rows_that_break_the_pattern_every_parameter_cost_a_row_each(monkeypatch, layout):
    """The rows checked stay linear in the keys: a pattern that breaks at once
    costs one row's check, not a pass over every FQN still to come."""
    fqns = [f"layers.{i}.{w}" for i in range(1000) for w in ("weight", "bias")]
    if layout == "nested-state":  # each parameter's nested key breaks its [step] row
        flat = {f"state.{f}.{k}": object() for f in fqns for k in ("step", "m.x")}
    else:  # weights and biases keep state under other names
        flat = {f"state.{f}.{k}": object() for f in fqns for k in (("a", "b") if f.endswith("weight") else ("c",))}
    checked = []
    matching = flat_format._Unflattening._matching
    monkeypatch.setattr(
        flat_format._Unflattening,
        "_matching",
        lambda self, keys, start, count, *rest: (checked.append(count), matching(self, keys, start, count, *rest))[1],
    )
    assert unflatten(flat, set(fqns)) == read_key_by_key(flat, set(fqns))
    assert sum(checked) <= 4 * len(fqns)


def flatten_key_by_key(nested: dict) -> dict:
    """The layout's rule for each leaf on its own (flat.py's docstring)."""
    out: dict = {}

    def put(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                put(f"{prefix}.{k}", v)
        elif type(value) is list and value:
            for i, v in enumerate(value):
                put(f"{prefix}[{i}]", v)
        else:
            out[prefix] = value

    for fqn, entry in nested[STATE].items():
        put(f"{STATE}.{fqn}", entry)
    for group in nested[GROUPS]:
        for fqn in group["params"]:
            for k, v in group.items():
                if k != "params":
                    out[f"{GROUPS}.{fqn}.{k}"] = v
    return out


def same_items(got: dict, expected: dict) -> bool:
    """The same keys in the same order, each with the very same value."""
    return [(k, id(v)) for k, v in got.items()] == [(k, id(v)) for k, v in expected.items()]


FLAT_FQNS = ["a", "a.b", "a.m", "b", "c.0", "x\ny"]  # "a" + "m.n" and "a.m" + "n" make one key
FLAT_NAMES = ["step", "exp_avg", "m.n", "n", "", "q\nr", "lr"]


@st.composite
def nested_dicts(draw) -> dict:
    fqns = draw(st.lists(st.sampled_from(FLAT_FQNS), unique=True, max_size=5))
    names = draw(st.lists(st.sampled_from(FLAT_NAMES), min_size=1, max_size=3, unique=True))
    state = {}
    for fqn in fqns:
        kind = draw(st.sampled_from(["row", "row", "row", "other-names", "nested", "empty", "not-a-dict"]))
        if kind == "row":
            state[fqn] = {name: object() for name in names}
        elif kind == "other-names":
            state[fqn] = {name: object() for name in reversed(names)} if len(names) > 1 else {"other": object()}
        elif kind == "nested":
            state[fqn] = {names[0]: draw(st.sampled_from([{"x": object()}, [object(), object()], {}, []]))}
        else:
            state[fqn] = {} if kind == "empty" else object()
    groups = []
    for _ in range(draw(st.integers(0, 2))):
        fields = draw(st.lists(st.sampled_from(FLAT_NAMES + [3]), max_size=3, unique=True))
        params = draw(st.lists(st.sampled_from(FLAT_FQNS), max_size=4))
        groups.append({**{k: object() for k in fields}, "params": params})
    return {STATE: state, GROUPS: groups}


def next_call(nested: dict, change: str) -> dict:
    """What a later get reads: new state values (as every get has), and maybe a group field's new value."""
    state = {fqn: {k: object() for k in e} if type(e) is dict else e for fqn, e in nested[STATE].items()}
    groups = [dict(g) for g in nested[GROUPS]]
    fields = [(g, k) for g in groups for k in g if k != "params"]
    if change == "field" and fields:
        group, key = fields[0]
        group[key] = object()
    return {STATE: state, GROUPS: groups}


@settings(max_examples=400, deadline=None)
@given(nested_dicts(), st.lists(st.sampled_from(["values", "field", "anew"]), max_size=4), st.data())
def test_flattening_by_columns_and_by_template_writes_each_leaf_as_alone(nested, changes, data):
    # (rows read and made in blocks of 1, 2 or 512 entries: see hyperdsd.blocks)
    with mock.patch.object(hyperdsd.blocks, "BLOCK", data.draw(st.sampled_from([1, 2, 512]), label="block")):
        _flattened_as_alone(nested, changes, data)


def _flattened_as_alone(nested, changes, data):
    template = flat_keys.KeptFlatKeys()
    assert same_items(flat_format.flatten(nested), flatten_key_by_key(nested))
    assert same_items(flat_format.flatten(nested, template), flatten_key_by_key(nested))
    reads_back(template, flatten_key_by_key(nested))
    for change in changes:
        nested = data.draw(nested_dicts()) if change == "anew" else next_call(nested, change)
        assert same_items(flat_format.flatten(nested, template), flatten_key_by_key(nested))
        reads_back(template, flatten_key_by_key(nested))


def reads_back(template, flat: dict, fqns=FLAT_FQNS) -> bool:
    """The template reads ``flat``, and the same keys with other values, as
    unflatten does, or not at all (None); a dict of other keys it does not read."""
    read = False
    for values in (flat, {k: object() for k in flat}, dict(list(flat.items())[1:])):
        got = template.read(values)
        if got is not None:
            state, fields, unknown, clashes = unflatten(values, set(fqns))
            assert got == (state, fields) and unknown == clashes == []
            read = read or values is flat
    assert template.read({**flat, "state.other.step": 1}) is None  # ("other": no FQN a template was made with)
    return read


def test_a_later_get_copies_the_template_and_puts_in_only_what_changed(monkeypatch):
    fqns = [f"layers.{i}.{w}" for i in range(200) for w in ("weight", "bias")]
    nested = {
        STATE: {f: {"step": object(), "exp_avg": object()} for f in fqns},
        GROUPS: [{"lr": 0.1, "betas": (0.9, 0.99), "params": fqns[:300]}, {"lr": 0.2, "params": fqns[300:]}],
    }
    template = flat_keys.KeptFlatKeys()
    assert same_items(flat_format.flatten(nested, template), flatten_key_by_key(nested))
    made = []
    row_keys = flat_keys.row_keys
    monkeypatch.setattr(flat_keys, "row_keys", lambda *args: (made.append(args[0]), row_keys(*args))[1])
    later = next_call(nested, "field")  # new state values, and the first group's lr a scheduler's new one
    assert later[GROUPS][0]["lr"] is not nested[GROUPS][0]["lr"]
    flat = flat_format.flatten(later, template)
    assert same_items(flat, flatten_key_by_key(later))
    assert made == []  # no key made again
    assert reads_back(template, flat, fqns)  # (read by the template, as unflatten reads it)
    for entry in later[STATE].values():
        entry["exp_avg_sq"] = object()  # a state name more: keys made anew
    assert same_items(flat_format.flatten(later, template), flatten_key_by_key(later))
    assert made


def test_a_parameter_in_two_groups_is_read_back_as_unflatten_reads_it():
    """(Optimizers refuse it, but a flat dict may hold it:) unflatten merges the two groups' fields."""
    nested = {STATE: {}, GROUPS: [{"lr": object(), "params": ["a"]}, {"eps": object(), "params": ["a", "b"]}]}
    template = flat_keys.KeptFlatKeys()
    flat = flat_format.flatten(nested, template)
    assert same_items(flat, flatten_key_by_key(nested))
    reads_back(template, flat)
    assert unflatten(flat, {"a", "b"})[1]["a"].keys() == {"lr", "eps"}
