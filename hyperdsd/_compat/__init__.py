"""Every private torch API hyperdsd touches, in one place: this package.

When a torch upgrade moves one of these, this package is the one to fix.
Each entry says why no public API does the job. A module per kind of torch
object: tensors, meshes and collectives (:mod:`.tensors`), modules and
optimizers (:mod:`.modules`), FSDP1 (:mod:`.fsdp1`), checkpoint files
(:mod:`.files`). The library names them through the package
(``_compat.local_tensor``).
"""

from .files import (
    archive_writer,
    dcp_global_plan_check,
    dcp_plan_caching,
    file_window,
    save_records,
    storage_dtypes,
    storage_info,
    tensor_archive,
)
from .fsdp1 import FSDP1_WRAPPED, Fsdp1Unit, fsdp1_class, fsdp1_reshard, fsdp1_unit, is_flat_param, is_fsdp1
from .modules import (
    LoadHooks,
    all_read_plainly,
    checkpoint_wrapper,
    child_modules,
    each_loads_plainly,
    fsdp2_class,
    fsdp2_reshard_hooks_off,
    fsdp2_sharded_params,
    has_extra_state,
    incompatible_keys,
    is_compiled_module,
    loads_by_copying,
    loads_plainly,
    module_state_hooks,
    optimizer_load_hooks,
    own_buffers,
    own_parameters,
    plain_state_dict,
    registries_fingerprint,
    unhooked_step,
)
from .tensors import (
    all_gather_into,
    collective_device,
    copy_each,
    detached,
    distribute_locally,
    dtensor_local,
    layout_token,
    local_tensor,
    root_mesh,
    version_of,
)

__all__ = [
    "dcp_global_plan_check",
    "dcp_plan_caching",
    "FSDP1_WRAPPED",
    "Fsdp1Unit",
    "LoadHooks",
    "all_gather_into",
    "all_read_plainly",
    "archive_writer",
    "checkpoint_wrapper",
    "child_modules",
    "collective_device",
    "copy_each",
    "detached",
    "distribute_locally",
    "each_loads_plainly",
    "dtensor_local",
    "file_window",
    "fsdp1_class",
    "fsdp1_reshard",
    "fsdp1_unit",
    "fsdp2_class",
    "fsdp2_reshard_hooks_off",
    "fsdp2_sharded_params",
    "has_extra_state",
    "incompatible_keys",
    "is_compiled_module",
    "is_flat_param",
    "is_fsdp1",
    "layout_token",
    "loads_by_copying",
    "loads_plainly",
    "local_tensor",
    "module_state_hooks",
    "optimizer_load_hooks",
    "own_buffers",
    "own_parameters",
    "plain_state_dict",
    "registries_fingerprint",
    "root_mesh",
    "save_records",
    "storage_dtypes",
    "storage_info",
    "tensor_archive",
    "unhooked_step",
    "version_of",
]
