"""This host's probes: its identity (boot id, namespaces, ``/dev/shm``)
and its addresses (interface table). Facts read from the kernel, no
policy: :mod:`streamcoll.startup.topology` builds a rank's facts from them and
:mod:`streamcoll.startup.launchers` uses them to pick rank 0's address under
mpiexec; a module below both, so that neither imports the other for them.
"""
from __future__ import annotations

import array
import fcntl
import ipaddress
import os
import socket
import struct
from typing import Dict, Optional, Tuple

__all__ = ["host_identity", "ipv4_addresses", "ipv6_addresses", "interface_of"]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def _ns(kind: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return "?"


def host_identity() -> Tuple[str, str, str]:
    """(identity, machine, network): what and why in docs/design.md, section
    'The facts each rank reports'; ``network`` (boot id and network
    namespace) is what loopback needs."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        st = os.stat("/dev/shm")
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "none"
    network = f"boot={boot} net={_ns('net')}"
    ident = f"{network} ipc={_ns('ipc')} pid={_ns('pid')} shm={shm}"
    return ident, boot, network


# ---------------------------------------------------------------- addresses
_SIOCGIFCONF = 0x8912
_IFREQ = 40  # sizeof(struct ifreq) on 64-bit Linux


def ipv4_addresses() -> Dict[str, str]:
    """Every labelled IPv4 address -> its interface (``SIOCGIFCONF``)."""
    out: Dict[str, str] = {}
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        n = 64
        while True:
            buf = array.array("B", bytes(_IFREQ * n))
            ifc = struct.pack("iL", len(buf), buf.buffer_info()[0])
            got = struct.unpack("iL", fcntl.ioctl(s.fileno(), _SIOCGIFCONF, ifc))[0]
            if got < len(buf) or n >= 4096:
                break
            n *= 4
        raw = buf.tobytes()
        for off in range(0, got, _IFREQ):
            name = raw[off:off + 16].split(b"\0", 1)[0].decode(errors="replace").split(":", 1)[0]
            out.setdefault(socket.inet_ntoa(raw[off + 20:off + 24]), name)
    finally:
        s.close()
    return out


def ipv6_addresses() -> Dict[str, str]:
    out: Dict[str, str] = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    out[str(ipaddress.IPv6Address(bytes.fromhex(parts[0])))] = parts[5]
    except OSError:
        pass
    return out


def interface_of(address: str) -> Optional[str]:
    """The interface holding the local ``address``, or None."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    table = ipv4_addresses() if ip.version == 4 else ipv6_addresses()
    return table.get(str(ip))
