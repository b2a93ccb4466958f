"""Rank side of the safety tests."""

import os
import socket
import stat


def workdir_mode(ctx, case_dir=None):
    modes = {"pool": stat.S_IMODE(os.stat(ctx.workdir).st_mode)}
    if case_dir:
        modes["case"] = stat.S_IMODE(os.stat(case_dir).st_mode)
    return modes


def listening_addresses(ctx):
    """Local addresses of the TCP sockets this rank listens on (gloo's)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/self/net/tcp", socket.AF_INET), ("/proc/self/net/tcp6", socket.AF_INET6)):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if inode in inodes and state == "0A":  # LISTEN
                addr_hex = local.split(":")[0]
                raw = bytes.fromhex(addr_hex)
                if family == socket.AF_INET:
                    raw = raw[::-1]
                else:
                    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                found.append(socket.inet_ntop(family, raw))
    return found
