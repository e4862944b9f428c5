"""What a rank can see of its machine: host, device, network interfaces, memory (no psutil)."""

from __future__ import annotations

import os
import socket


def interfaces() -> list[dict]:
    """Network interfaces of this host with their link speed (bytes/s) where the kernel knows it.

    Read from /sys/class/net/<if>/speed (Mbit/s; -1 or unreadable for virtual links, then None),
    falling back to socket.if_nameindex() where /sys is not there. Loopback is left out.
    """
    base = "/sys/class/net"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        names = sorted(n for _, n in socket.if_nameindex())
    out = []
    for name in names:
        if name == "lo":
            continue
        speed = None
        try:
            with open(os.path.join(base, name, "speed")) as f:
                mbit = int(f.read().strip())
            if mbit > 0:
                speed = mbit * 1e6 / 8
        except (OSError, ValueError):
            pass
        out.append({"name": name, "speed_bytes_per_s": speed})
    return out


def host_memory_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def private_memory_bytes() -> float:
    """Anonymous (private heap) memory of this process, from /proc/self/smaps_rollup.

    Shared library pages (libtorch is hundreds of MB) are excluded: every rank on a host maps the
    same file pages, so counting them per rank would charge them several times.
    """
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Anonymous:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def machine_id() -> str:
    """The running kernel's boot id: the same for every process of one machine, whatever host name
    or network namespace it has (emulated nodes, containers); '' where the kernel does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def host_info() -> dict:
    return {"name": socket.gethostname(), "interfaces": interfaces(), "cpu_count": os.cpu_count() or 0,
            "memory_bytes": host_memory_bytes(), "machine": machine_id()}


def rank_info(rank: int, local_rank: int, local_world_size: int) -> dict:
    """This rank's device as the profile records it (see autoconf.specs.profile.RankInfo)."""
    import torch

    from autoconf.specs.profile import catalog_kind

    if torch.cuda.is_available():
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        name, mem = props.name, float(props.total_memory)
    else:
        name, mem = "cpu", host_memory_bytes() / max(1, local_world_size)
    return {"rank": rank, "host": socket.gethostname(), "local_rank": local_rank, "device_name": name,
            "device_kind": catalog_kind(name, mem), "memory_bytes": mem}
