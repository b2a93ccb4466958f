"""Run a command and report the peak memory of its whole process tree.

Sums the proportional set size (PSS: shared pages split among the processes
that map them, so torch's libraries count once) of the command and every
descendant, sampled every 0.2 s from /proc; prints the peak, the number of
processes at that moment, and the wall time. Linux only.

    python -m tools.benchmarks.peak_memory -- pytest --pyargs conformance --dsd-impl hyperdsd -n 2 -q
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(parent, []).append(int(name))
    return tree


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_pss(root: int) -> tuple[int, int]:
    """(PSS in KiB, process count) of ``root`` and its descendants."""
    tree, todo, seen = _children(), [root], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        todo.extend(tree.get(pid, ()))
    return sum(_pss_kib(p) for p in seen), len(seen)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.benchmarks.peak_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command")
    start = time.monotonic()
    proc = subprocess.Popen(command)
    peak, procs = 0, 0
    while proc.poll() is None:
        pss, n = tree_pss(proc.pid)
        if pss > peak:
            peak, procs = pss, n
        time.sleep(0.2)
    took = time.monotonic() - start
    print(
        f"peak memory (PSS of the process tree): {peak / 1024:.0f} MiB with {procs} processes; "
        f"wall {took:.0f} s; exit {proc.returncode}",
        file=sys.stderr,
    )
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
