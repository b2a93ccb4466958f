"""Private torch APIs live in one file, hyperdsd/_compat.py, each with its reason.

A torch upgrade breaks private APIs first; keeping them in one place keeps
the fix in one place. This test parses the sources (library, suite, tools)
and names every use of a private torch module, name or attribute elsewhere.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
ALLOWED = {ROOT / "hyperdsd" / "_compat.py"}
TORCH_NAMES = {"torch", "dist", "nn", "F"}  # how the sources name torch's modules
# Private attributes of torch objects (modules, tensors, optimizers, groups).
PRIVATE_ATTRS = {
    "_local_tensor", "_version", "_get_sequence_number_for_group", "_world", "_modules", "_parameters", "_buffers",
    "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks", "_EXTRA_STATE_KEY_SUFFIX", "_get_default_store", "_get_default_group",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.AST) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def private_uses(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(_private(part) for part in node.module.split(".")) or any(_private(a.name) for a in node.names):
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and any(_private(p) for p in alias.name.split(".")):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if node.attr in PRIVATE_ATTRS or _root(node) in TORCH_NAMES:
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_private_torch_apis_only_in_compat():
    offenders = []
    for folder in ("hyperdsd", "conformance", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path in ALLOWED:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in private_uses(path.read_text())]
    assert offenders == [], "private torch APIs outside hyperdsd/_compat.py:\n" + "\n".join(offenders)


def test_the_fence_sees_what_it_guards():
    caught = [
        "from torch.utils._pytree import tree_map",
        "import torch.distributed._functional_collectives",
        "from torch.nn.modules.module import _IncompatibleKeys",
        "groups = dist.distributed_c10d._world.pg_group_ranks",
        "local = t._local_tensor",
        "children = module._modules.items()",
    ]
    for sample in caught:
        assert private_uses(sample), sample
    allowed = [
        "from torch.distributed.tensor import DTensor, Shard",
        "from torch.distributed.fsdp import fully_shard as _fully_shard",
        "self._meshes[spec] = mesh",
    ]
    for sample in allowed:
        assert not private_uses(sample), sample
