"""Every rendezvous and gloo socket of a job listens on loopback (local spawn) or on the configured
interface only (megatron_rl/parallel/netbind.py)."""

from __future__ import annotations

import datetime
import threading

import psutil
import pytest
import torch.distributed as dist

from megatron_rl.parallel import netbind
from megatron_rl.parallel.launch import free_port, spawn


def _listening(pid: int | None = None) -> list[tuple[str, int]]:
    """``(address, port)`` of every listening TCP socket of the process."""
    proc = psutil.Process(pid)
    return sorted((c.laddr.ip, c.laddr.port) for c in proc.net_connections("inet")
                  if c.status == psutil.CONN_LISTEN)


def _job_sockets() -> list[tuple[str, int]]:
    """One rank of a local spawn: the default group, the host group and a megatron-style gloo
    subgroup, and a weight-sync group hosted by rank 0 (the trainer's sender) that rank 1 joins;
    the rank's listening sockets while all of them are alive."""
    from megatron_rl.parallel import runtime
    from megatron_rl.rollout.weight_sync.group import join_weight_group, leave_weight_group

    runtime.init_distributed(backend="gloo", timeout_s=120)
    sub = dist.new_group([0, 1], backend="gloo")
    dist.barrier(group=sub)
    port = [free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    pg = join_weight_group("gloo", "127.0.0.1", port[0], 2, dist.get_rank(), "mrl_test_g1",
                           timeout=datetime.timedelta(seconds=120))
    dist.barrier()
    got = _listening()
    dist.barrier()
    leave_weight_group(pg)
    return got


def test_local_job_listens_on_loopback_only():
    """Two gloo ranks spawned like ``train`` does: rank 0's rendezvous store, the gloo pair
    listeners of every group, the weight-sync group's store: all on 127.0.0.1. (torch's defaults:
    the store on every interface, gloo on the hostname's.)"""
    per_rank = spawn(_job_sockets, 2, timeout_s=300)
    assert all(per_rank), per_rank  # gloo listens on every rank, rank 0 hosts the stores
    assert len(per_rank[0]) >= 3, per_rank[0]  # 2 stores + gloo
    for rank, socks in enumerate(per_rank):
        assert {ip for ip, _ in socks} == {"127.0.0.1"}, (rank, socks)


def _non_loopback() -> tuple[str, str] | None:
    for name, addrs in netbind.interface_addresses().items():
        v4 = [a for a in addrs if "." in a and not a.startswith("127.")]
        if v4:
            return name, v4[0]
    return None


def test_bind_plan_and_store_on_the_configured_interface():
    """A loopback MASTER_ADDR keeps everything on loopback; ``parallel.socket_ifname`` binds the
    store to that interface's address (the clients still meet it at MASTER_ADDR); an unknown
    interface, or a MASTER_ADDR that is not on it, is a clear error; nothing configured leaves
    torch's defaults."""
    lo = netbind.loopback_interface()
    assert netbind.bind_plan("127.0.0.1") == netbind.BindPlan("127.0.0.1", lo)
    assert netbind.bind_plan("localhost", "eth7") == netbind.BindPlan("127.0.0.1", lo)
    assert netbind.bind_plan("node7") == netbind.BindPlan(None, None)
    with pytest.raises(netbind.BindError, match=r"parallel.socket_ifname='nope0'.*interfaces: "):
        netbind.bind_plan("node7", "nope0")
    other = _non_loopback()
    if other is None:
        pytest.skip("no non-loopback interface on this machine")
    ifname, addr = other
    assert netbind.bind_plan(addr, ifname) == netbind.BindPlan(addr, ifname)
    assert netbind.bind_plan("node7", ifname, rank=1) == netbind.BindPlan(addr, ifname)
    with pytest.raises(netbind.BindError, match=r"MASTER_ADDR='203.0.113.9' resolves to "):
        netbind.bind_plan("203.0.113.9", ifname)  # rank 0 checks MASTER_ADDR is on the interface
    port, timeout = free_port(), datetime.timedelta(seconds=30)
    made: dict = {}  # the master's constructor waits for the other rank: run it in a thread
    t = threading.Thread(target=lambda: made.setdefault(
        "master", netbind.rendezvous_store(addr, port, 2, True, timeout, addr)))
    t.start()
    client = netbind.rendezvous_store(addr, port, 2, False, timeout, addr)
    t.join(30)
    client.set("k", "v")
    assert made["master"].get("k") == b"v"
    assert [ip for ip, p in _listening() if p == port] == [addr]
    with pytest.raises(netbind.BindError, match="cannot listen on 203.0.113.9"):
        netbind.rendezvous_store(addr, free_port(), 1, True, timeout, "203.0.113.9")
