"""Where the job's rendezvous stores and gloo sockets listen.

torch's ``tcp://`` rendezvous starts its ``TCPStore`` server on every interface (``::``), whatever
address the clients are given, and gloo binds the interface that the hostname resolves to. This
module narrows both:

* :func:`rendezvous_store`: rank 0's store listens on one address only (a socket bound to it,
  handed to the store as ``master_listen_fd``; the other ranks are plain clients);
* :func:`bind_plan`: which address and gloo interface a job uses: loopback when ``MASTER_ADDR``
  is a loopback address (a local spawn: every rank is on this machine), the address of
  ``parallel.socket_ifname`` when one is configured, else torch's defaults (all interfaces);
* :func:`gloo_interface`: a gloo group created inside it binds the given interface (the
  ``GLOO_SOCKET_IFNAME`` that torch reads when it makes a gloo group).

Under ``torchrun`` the agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE=True``); the ranks
are then clients and only the gloo interface is set here.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Iterator

GLOO_IFNAME_VAR = "GLOO_SOCKET_IFNAME"


class BindError(ValueError):
    """An interface or address to bind to does not exist on this machine."""


def is_loopback(host: str) -> bool:
    """``localhost``, ``127.x.y.z`` or ``::1``."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def interface_addresses() -> dict[str, list[str]]:
    """``{interface name: [IPv4 addresses..., IPv6 addresses...]}`` of this machine."""
    import psutil

    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        v6 = [a.address.split("%")[0] for a in addrs if a.family == socket.AF_INET6]
        if v4 or v6:
            out[name] = v4 + v6
    return out


def interface_of(address: str) -> str | None:
    """The interface that holds ``address``, or None."""
    for name, addrs in interface_addresses().items():
        if address in addrs:
            return name
    return None


def loopback_interface() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS)."""
    return interface_of("127.0.0.1") or "lo"


def interface_address(ifname: str, field: str = "parallel.socket_ifname") -> str:
    """The first IPv4 (else IPv6) address of ``ifname``; :class:`BindError` naming ``field`` and
    the interfaces that exist when there is no such interface."""
    addrs = interface_addresses()
    if ifname not in addrs:
        have = ", ".join(f"{n} ({a[0]})" for n, a in sorted(addrs.items()))
        raise BindError(f"{field}={ifname!r}: no such network interface with an address on "
                        f"{socket.gethostname()}; interfaces: {have}")
    return addrs[ifname][0]


@dataclass(frozen=True)
class BindPlan:
    """``store_address``: the only address rank 0's rendezvous store listens on (None: torch's
    default, every interface); ``gloo_ifname``: the interface gloo binds (None: torch's default,
    the hostname's)."""

    store_address: str | None
    gloo_ifname: str | None


def bind_plan(master_addr: str, socket_ifname: str = "", rank: int = 0) -> BindPlan:
    """Where this rank's job listens. A loopback ``MASTER_ADDR`` means every rank is on this
    machine (nothing else can reach a loopback address): the store and gloo stay on loopback.
    Otherwise ``socket_ifname`` (``parallel.socket_ifname``), when set, is the interface of both;
    rank 0 checks that ``MASTER_ADDR`` is one of its addresses (the other ranks connect there).
    Neither: torch's defaults."""
    if is_loopback(master_addr):
        return BindPlan("127.0.0.1" if master_addr.lower() == "localhost"
                        else master_addr.strip("[]"), loopback_interface())
    if not socket_ifname:
        return BindPlan(None, None)
    address = interface_address(socket_ifname)
    if rank == 0:
        mine = interface_addresses()[socket_ifname]
        resolved = _resolve(master_addr)
        if not set(resolved) & set(mine):
            raise BindError(
                f"parallel.socket_ifname={socket_ifname!r} has address(es) {', '.join(mine)} on "
                f"rank 0's host {socket.gethostname()}, but MASTER_ADDR={master_addr!r} resolves "
                f"to {', '.join(resolved) or 'nothing'} there: set MASTER_ADDR to the address of "
                f"{socket_ifname} (the other ranks connect to it), or choose the interface that "
                "holds MASTER_ADDR")
        address = next(a for a in resolved if a in mine)
    return BindPlan(address, socket_ifname)


def _resolve(host: str) -> list[str]:
    try:
        return sorted({i[4][0].split("%")[0] for i in socket.getaddrinfo(host, None)})
    except OSError:
        return []


def agent_hosts_store() -> bool:
    """True under ``torchrun``'s agent store (the ranks are clients of the agent's store)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def rendezvous_store(master_addr: str, port: int, world_size: int, is_master: bool,
                     timeout: datetime.timedelta, bind_address: str):
    """A ``TCPStore`` for a ``world_size``-process rendezvous at ``master_addr:port``. The master's
    server listens on ``bind_address`` only: a socket bound there is handed to the store (which
    owns it from then on). The others connect to ``master_addr``. Same keys as torch's ``tcp://``
    rendezvous."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(master_addr, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in bind_address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind_address, port))
        sock.listen(max(128, world_size))
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {bind_address}:{port} for the rendezvous: "
                        f"{exc}") from exc
    return dist.TCPStore(master_addr, port, world_size, True, timeout,
                         master_listen_fd=sock.detach(), use_libuv=True)


@contextlib.contextmanager
def gloo_interface(ifname: str | None) -> Iterator[None]:
    """gloo groups created inside bind ``ifname`` (None: unchanged). Restores the variable."""
    if ifname is None:
        yield
        return
    old = os.environ.get(GLOO_IFNAME_VAR)
    os.environ[GLOO_IFNAME_VAR] = ifname
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(GLOO_IFNAME_VAR, None)
        else:
            os.environ[GLOO_IFNAME_VAR] = old


def routed_address(host: str) -> str | None:
    """This machine's IPv4 address on the interface the kernel routes to ``host`` (a UDP
    ``connect``, which sends nothing); None when there is no route."""
    try:
        target = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(target)
            return s.getsockname()[0]
    except OSError:
        return None
