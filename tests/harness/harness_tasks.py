"""Task functions for the harness tests; importable by spawned ranks."""

import os
import signal
import threading
import time

import torch
import torch.distributed as dist


def all_reduce_rank(ctx):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return t.item()


def noop(ctx):
    return ctx.rank


def parent_and_sum(ctx):
    """This rank's parent process and an all-reduce of the ranks."""
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    return os.getppid(), t.item()


def hang_in_collective(ctx, rank=1):
    if ctx.rank == rank:
        dist.all_reduce(torch.ones(1))  # nobody else joins
    return ctx.rank


def sleep_forever(ctx, rank=1):
    if ctx.rank == rank:
        while True:
            time.sleep(1)
    dist.barrier()


def exit_code(ctx, rank=2, code=3):
    if ctx.rank == rank:
        os._exit(code)
    dist.barrier()


def sigkill(ctx, rank=3):
    if ctx.rank == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def raise_while_others_wait(ctx, rank=1):
    if ctx.rank == rank:
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    dist.barrier()


def mismatched_count(ctx):
    """Ranks leave with different collective counts on the world group."""
    if ctx.rank == 0:
        _ = dist.all_reduce(torch.ones(1), async_op=True)
        raise RuntimeError("rank 0 gives up after posting a collective")
    time.sleep(0.2)
    raise RuntimeError(f"rank {ctx.rank} gives up without one")


def mesh_sum(ctx, spec="2x2", dim="shard"):
    mesh = ctx.mesh(spec)
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.get_group(dim))
    return t.item()


def not_applicable(ctx):
    from hyperdsd.testing import NotApplicable

    raise NotApplicable("does not apply here")


def spawn_child(ctx, marker):
    """Start a grandchild that would outlive the rank if nobody killed it."""
    import subprocess
    import sys

    if ctx.rank == 0:
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"], env=dict(os.environ, HYPERDSD_TEST_MARK=marker)
        )
        with ctx.under_test("child started"):  # where the controller finds this rank at the deadline
            time.sleep(600)
    time.sleep(600)


def leak_thread(ctx):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    return ctx.rank


def print_and_fail(ctx):
    print(f"hello from rank {ctx.rank}", flush=True)
    assert ctx.rank != 1, "rank 1 disagrees"


def leak_child(ctx, marker):
    """Start a child process and return without waiting for it."""
    import subprocess
    import sys

    if ctx.rank == 0:
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"], env=dict(os.environ, HYPERDSD_TEST_MARK=marker)
        )
    return ctx.rank


def raise_after_importing_fsdp(ctx, rank=1):
    """Some torch modules keep process groups alive once imported; leaving must still release the others."""
    import torch.distributed.fsdp  # noqa: F401

    if ctx.rank == rank:
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    dist.barrier()


def fail_in_region(ctx, rank=1, label="set_optimizer_state_dict"):
    """The code under test raises on one rank; the others wait for it inside it."""
    with ctx.under_test(label):
        if ctx.rank == rank:
            raise ValueError("the code under test fails")
        dist.barrier()


def fail_outside_region(ctx):
    with ctx.under_test("get_model_state_dict"):
        dist.barrier()
    raise KeyError("the task's own code is broken")


def check_fails_outside_region(ctx):
    with ctx.under_test("get_model_state_dict"):
        value = ctx.rank
    assert value < 0, "a check on what the code under test returned"


def hang_in_region(ctx, rank=1, label="get_optimizer_state_dict"):
    with ctx.under_test(label):
        if ctx.rank == rank:
            while True:
                time.sleep(1)
    dist.barrier()
