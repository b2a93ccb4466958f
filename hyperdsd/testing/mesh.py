"""Device meshes written as strings: ``"4"`` is a 1-D mesh of four ranks,
``"2x2"`` a 2-D mesh whose dims are named ``replicate`` and ``shard``."""

from __future__ import annotations

import math
from dataclasses import dataclass

_DEFAULT_NAMES = {1: ("shard",), 2: ("replicate", "shard")}


@dataclass(frozen=True)
class MeshSpec:
    shape: tuple[int, ...]
    dim_names: tuple[str, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return "x".join(str(s) for s in self.shape)


def parse_mesh(spec: str | MeshSpec, dim_names: tuple[str, ...] | None = None) -> MeshSpec:
    """Parse ``"4"``, ``"2x2"`` or ``"2x1x2"`` into a :class:`MeshSpec`."""
    if isinstance(spec, MeshSpec):
        return spec if dim_names is None else MeshSpec(spec.shape, tuple(dim_names))
    text = str(spec).strip().lower()
    try:
        shape = tuple(int(part) for part in text.split("x"))
    except ValueError:
        raise ValueError(f"mesh {spec!r}: expected sizes joined by 'x', such as '4' or '2x2'") from None
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"mesh {spec!r}: every dim must be a positive integer")
    if dim_names is None:
        if len(shape) not in _DEFAULT_NAMES:
            raise ValueError(f"mesh {spec!r}: a {len(shape)}-D mesh needs explicit dim names")
        dim_names = _DEFAULT_NAMES[len(shape)]
    if len(dim_names) != len(shape) or len(set(dim_names)) != len(dim_names):
        raise ValueError(f"mesh {spec!r}: dim names {dim_names} must be {len(shape)} distinct names")
    return MeshSpec(shape, tuple(dim_names))


def build_mesh(spec: MeshSpec, device_type: str = "cpu"):
    """Create the DeviceMesh (a collective: every rank of the world calls it)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, spec.shape, mesh_dim_names=spec.dim_names)
