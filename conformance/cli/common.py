"""What the commands share: the default implementation, argument types, the
usage error, and the device and backend check."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

DEFAULT_IMPL = "hyperdsd"


class UsageError(Exception):
    pass


def as_command(prog: str, fn: Callable, args) -> int:
    """``fn(args)``'s exit status, the implementation defaulted from the
    environment; a usage error is printed as argparse prints its own (status 2)."""
    if args.impl is None:
        args.impl = os.environ.get("CONFORMANCE_IMPL", DEFAULT_IMPL)
    try:
        return fn(args)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("the timeout must be positive")
    return value


def count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("the count must be at least 1")
    return value


def check_device(device: str, backend: str | None) -> str:
    """The backend to use; a usage error for a device or backend torch does not have here."""
    import torch
    import torch.distributed as dist

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"--device {device!r} is not a torch device type: {exc}") from None
    if kind != device:
        raise UsageError(
            f"--device takes a device type such as 'cpu' or 'cuda' (each rank picks its own index), got {device!r}"
        )
    if kind != "cpu":
        module = getattr(torch, kind, None)
        available = module is not None and callable(getattr(module, "is_available", None)) and module.is_available()
        if not available:
            raise UsageError(
                f"--device {kind}: torch.{kind} is not available on this machine (torch {torch.__version__})"
            )
    if backend is None:
        backend = dist.Backend.default_device_backend_map.get(kind, "gloo")
    if not dist.is_backend_available(backend):
        raise UsageError(f"--backend {backend}: this torch build has no such process-group backend")
    return backend
