"""After a launched group has formed, nobody may open a new connection to this rank.

gloo's data connections are not authenticated, and gloo's listener stays open for the
whole run: every connection a stranger opens and abandons costs the rank one file
descriptor that gloo never gives back (measured: 3,000 connections that each send 8
bytes and close left 3,000 more descriptors in rank 0), until ``accept`` fails with
"Too many open files" and gloo aborts the process. gloo offers no way to close its
listener, and it needs none once every pair is connected (torch connects the full mesh
while the group forms). So, on Linux, every listening TCP socket of the rank (gloo's,
and on rank 0 the loopback store's) gets a socket filter that drops every incoming
packet: a new connection's SYN is discarded before it makes a socket, while the
connections already made are untouched. Elsewhere (macOS) nothing is sealed; a firewall
rule is the protection there (docs/security.md).
"""

from __future__ import annotations

import ctypes
import os
import socket
import stat
import struct
import sys
from collections.abc import Iterable

SO_ATTACH_FILTER = 26  # Linux, <asm-generic/socket.h>
SO_ACCEPTCONN = getattr(socket, "SO_ACCEPTCONN", 30)
#: Added to a rank's error when it failed inside gloo: the likely outside cause.
GLOO_HINT = ("gloo failed; if connections from outside the run reached gloo's ports (a port "
             "scan, a flood), close them to non-inventory addresses: see docs/security.md")
#: One classic BPF instruction, ``ret #0``: keep no byte of any packet (drop it).
_DROP_ALL = struct.pack("HBBI", 0x06, 0, 0, 0)


#: The address other ranks reach this rank at (the inventory's ``advertise``), set by the launcher.
ADVERTISE_ENV = "MESHTRAIN_ADVERTISE"
# ioctl that reads an interface's IPv4 address: Linux <linux/sockios.h>, macOS <sys/sockio.h>.
_SIOCGIFADDR = {"linux": 0x8915, "darwin": 0xC0206921}


def interface_with_address(address: str) -> str | None:
    """The name of this machine's network interface that holds IPv4 ``address`` (a name is
    resolved first), or None when none does or this system cannot tell."""
    request = _SIOCGIFADDR.get("darwin" if sys.platform == "darwin" else sys.platform[:5])
    try:
        import fcntl

        wanted = socket.gethostbyname(address)
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return None
    if request is None:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                answer = fcntl.ioctl(probe.fileno(), request, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(answer[20:24]) == wanted:
                return name
    return None


def interface_environment(iface: str) -> dict[str, str]:
    """The variables that put both backends' sockets on network interface ``iface``: gloo's
    (CPU ranks) and nccl's (CUDA ranks; ``=`` makes nccl match the name exactly, not as a
    prefix: ``en0`` would also match ``en01``)."""
    return {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": f"={iface}"}


def bind_gloo_to_advertise() -> str | None:
    """Make gloo (and nccl) listen on this rank's advertised address only: without an
    ``iface`` in the inventory, gloo would take the address the host's name resolves to
    (often 127.0.0.1, or every interface's), and nccl the first interface its own rules pick.
    Sets :func:`interface_environment` for the interface holding that address; returns it
    (None: left as it was)."""
    advertise = os.environ.get(ADVERTISE_ENV)
    if not advertise or os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    name = interface_with_address(advertise)
    if name is not None:
        for key, value in interface_environment(name).items():
            os.environ.setdefault(key, value)
    return name


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit: (soft, hard) after.

    Buys headroom against a flood of connections that reaches gloo before it is sealed."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY and sys.platform == "darwin":
        hard = 10240  # macOS refuses RLIM_INFINITY for the soft limit (OPEN_MAX)
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # keep what we have
    return soft, hard


def listening_tcp_sockets() -> list[int]:
    """File descriptors of this process that are listening TCP sockets (Linux: /proc)."""
    found = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for name in names:
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (probe.family in (socket.AF_INET, socket.AF_INET6) and probe.type == socket.SOCK_STREAM
                    and probe.getsockopt(socket.SOL_SOCKET, SO_ACCEPTCONN)):
                found.append(fd)
        except OSError:
            pass
        finally:
            probe.close()  # closes the duplicate only
    return found


def seal_listening_sockets(fds: Iterable[int] | None = None) -> list[str]:
    """Drop every new connection to this process's listening TCP sockets (or to those of
    ``fds``) from now on; the addresses sealed (``host:port``). Linux only: elsewhere
    returns []."""
    if not sys.platform.startswith("linux"):
        return []
    program = ctypes.create_string_buffer(_DROP_ALL)
    fprog = struct.pack("HP", 1, ctypes.addressof(program))  # struct sock_fprog
    sealed = []
    for fd in listening_tcp_sockets() if fds is None else fds:
        sock = socket.socket(fileno=os.dup(fd))  # the filter belongs to the socket, not the fd
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
            host, port = sock.getsockname()[:2]
            sealed.append(f"{host}:{port}")
        except OSError:
            pass
        finally:
            sock.close()
    return sealed
