"""How many bytes a rank receives through torch.distributed while a block
runs: the check behind SPEC's memory bounds (OPT-RT-3, MODEL-3).

A rank can only come to hold another rank's state by receiving it, so the
bytes of every receiving buffer of every collective (and point-to-point
receive) the implementation issues bound what it can hold of others' state.
Counted per call by the arguments that receive: a gather's list on its
destination, a broadcast's tensor on the others, an all-gather's output...
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

# name -> (receiving argument: position, keyword), and the root argument that
# does not receive (its own data goes out), if any
_RECEIVERS = {
    "broadcast": ((0, "tensor"), "src"),
    "scatter": ((0, "tensor"), None),
    "all_gather": ((0, "tensor_list"), None),
    "all_gather_into_tensor": ((0, "output_tensor"), None),
    "all_gather_single": ((0, "output_tensor"), None),
    "gather": ((1, "gather_list"), None),
    "recv": ((0, "tensor"), None),
    "irecv": ((0, "tensor"), None),
    "all_reduce": ((0, "tensor"), None),
    "reduce_scatter_tensor": ((0, "output"), None),
    "all_to_all": ((0, "output_tensor_list"), None),
    "all_to_all_single": ((0, "output"), None),
    "broadcast_object_list": ((0, "object_list"), "src"),
    "all_gather_object": ((0, "object_list"), None),
    "gather_object": ((1, "object_gather_list"), None),
    "scatter_object_list": ((0, "scatter_object_output_list"), None),
}


class ReceiveMeter:
    """Bytes this rank receives while active: in total and in the largest call."""

    def __init__(self):
        self.largest = 0
        self.total = 0
        self.calls = 0
        self._saved = {}

    def __enter__(self):
        for name, spec in _RECEIVERS.items():
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(fn, *spec))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def _wrap(self, fn, receiver, root_arg):
        position, keyword = receiver

        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            root = kwargs.get(root_arg) if root_arg else None
            if root_arg and root is None and len(args) > 1:
                root = args[1]
            if root is None or root != dist.get_rank():
                buf = args[position] if len(args) > position else kwargs.get(keyword)
                size = _nbytes(buf)
                self.largest = max(self.largest, size)
                self.total += size
            self.calls += 1
            return out

        return wrapper


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    if obj is None or isinstance(obj, (int, float, str, bool, dist.ProcessGroup)):
        return 0
    try:
        return len(pickle.dumps(obj))
    except Exception:
        return 0
