"""Pairing a checkpoint's param groups with the target optimizers' groups.

Groups pair by the parameters they hold, not by position, so that a target
that lists its groups in another order still loads each group's fields into
the right group. A group with parameters pairs with the checkpoint group
that holds its first parameter; groups without parameters have nothing to
pair by, so they pair in order among themselves. Anything left over, or a
pair whose parameters differ, is a problem a strict load refuses, named by
the group's position (``param_groups[i]``) and its ``name`` field if it has one.
"""

from __future__ import annotations

SHOWN = 12  # names an error lists before it counts the rest


def shown_names(names) -> str:
    names = list(names)
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return str(names[:SHOWN]) + more


def _label(groups: list[dict], i: int) -> str:
    name = groups[i].get("name") if isinstance(groups[i], dict) else None
    return f"param_groups[{i}]" + (f" ({name!r})" if isinstance(name, str) else "")


def pair_groups(targets: list[tuple[int, dict, list[str]]], ckpt: list[dict], known: set[str]):
    """[(target group index, checkpoint group index or None)] and the problems found, in words."""
    target_groups = [g for _, g, _ in targets]
    ckpt_fqns = [[f for f in g["params"] if f in known] for g in ckpt]
    owner: dict[str, int] = {}
    for ci, fqns in enumerate(ckpt_fqns):
        for f in fqns:
            owner.setdefault(f, ci)
    empties = iter([ci for ci, g in enumerate(ckpt) if not g["params"]])
    pairs, problems, used = [], [], set()
    for ti, (_, _, fqns) in enumerate(targets):
        if not fqns:
            ci = next(empties, None)
            if ci is None:
                problems.append(
                    f"the target's {_label(target_groups, ti)} (no parameters) has no counterpart in the checkpoint"
                )
        else:
            ci = next((owner[f] for f in fqns if f in owner), None)
            if ci is None:
                problems.append(
                    f"the target's {_label(target_groups, ti)} has no group in the checkpoint "
                    f"(its parameters {shown_names(fqns)})"
                )
            else:
                lacks = [f for f in fqns if f not in set(ckpt_fqns[ci])]
                extra = [f for f in ckpt_fqns[ci] if f not in set(fqns)]
                if lacks or extra:
                    problems.append(
                        f"the checkpoint's {_label(ckpt, ci)} pairs with the target's {_label(target_groups, ti)} "
                        f"but lacks {shown_names(lacks)} and has {shown_names(extra)} besides"
                    )
        if ci is not None:
            used.add(ci)
        pairs.append((ti, ci))
    for ci in range(len(ckpt)):
        if ci not in used:
            problems.append(f"the checkpoint's {_label(ckpt, ci)} has no counterpart in the target")
    if len(ckpt) != len(targets):
        problems.insert(0, f"the checkpoint has {len(ckpt)} param groups, the target {len(targets)}")
    return pairs, problems
