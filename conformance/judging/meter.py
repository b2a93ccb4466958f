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

# name -> (receiving argument: position, keyword), and the root argument
# (position, keyword) that does not receive (its own data goes out), if any
_RECEIVERS = {
    "broadcast": ((0, "tensor"), (1, "src")),
    "_broadcast_coalesced": ((1, "tensors"), (3, "src")),  # (group, tensors, buffer_size, src): torch's own bcast loads
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
    "broadcast_object_list": ((0, "object_list"), (1, "src")),
    "all_gather_object": ((0, "object_list"), None),
    "gather_object": ((1, "object_gather_list"), None),
    "scatter_object_list": ((0, "scatter_object_output_list"), None),
}


class ReceiveMeter:
    """Bytes this rank receives while active: in total and in the largest
    call, and the *payload*: the bytes of tensors (and raw bytes) among them,
    which is what a rank can come to hold of others' state. Control messages
    (names, shapes, dtypes: what objects hold besides tensors) are not
    payload; their size grows with the number of entries, not with the
    state, and on the suite's small models exceeds the state itself."""

    def __init__(self):
        self.largest = 0
        self.total = 0
        self.payload = 0
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
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.count(_arg(args, kwargs, root_arg), _arg(args, kwargs, receiver))
            return out

        return wrapper

    def count(self, root, received) -> None:
        """Count one call's receiving buffer (after the call: what arrived),
        unless this rank is the call's root."""
        if root is None or root != dist.get_rank():
            size = _nbytes(received)
            self.largest = max(self.largest, size)
            self.total += size
            self.payload += payload_bytes(received)
        self.calls += 1


def _arg(args, kwargs, where):
    if where is None:
        return None
    position, keyword = where
    return args[position] if len(args) > position else kwargs.get(keyword)


def payload_bytes(obj, _seen=None) -> int:
    """The bytes of tensors and raw bytes in ``obj``, through containers and
    objects' attributes: state, wherever it travels."""
    if obj is None or isinstance(obj, (int, float, complex, str, bool, torch.dtype, torch.Size, dist.ProcessGroup)):
        return 0
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return 0  # shared (or cyclic): it arrived once
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(k, seen) + payload_bytes(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(payload_bytes(o, seen) for o in obj)
    inner = getattr(obj, "__dict__", None)
    return payload_bytes(inner, seen) if isinstance(inner, dict) else 0


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
