"""Hosts of their own on one machine: a network namespace per service, joined by a bridge.

Each host is a network namespace with one veth (`eth0`, a real non-loopback address) whose
peer sits on a Linux bridge, the "switch". The switch has a namespace of its own: the root
namespace's firewall never sees the hosts' packets (Docker's `FORWARD` policy drop, applied to
bridged traffic through br_netfilter, silenced every host here once dockerd ran). The root
namespace has one more port on it, holding the subnet's first address, so the bench itself
reaches every host. A partition is an nftables drop rule on the switch (`bridge` family,
forward hook): packets between two hosts vanish, one way or both, while every process runs on
and every connection stays open: what a failed switch port or a firewall change does to a
cluster, and what a loopback proxy cannot show (the kernel's own connect and retransmission
timeouts apply). ARP still crosses, so a cut host is silent, not unreachable.

Needs root, `ip` (iproute2) and `nft` (Debian's `nftables`); `missing()` says what is absent.
Used by `bench/chaos.py --hosts netns` and its tests.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass

IFNAME = "eth0"  # the veth's name inside every host: GLOO_SOCKET_IFNAME for the weight group


def missing() -> str | None:
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian package {package})"
    return None


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str


class HostNetwork:
    """`up()` makes the hosts, `down()` removes them (and every rule); `cut`/`heal` partition."""

    def __init__(self, names: list[str], subnet: str | None = None) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and non-empty: {names}")
        self.tag = secrets.token_hex(3)  # interface names hold 15 characters
        net = ipaddress.ip_network(subnet or f"10.{200 + secrets.randbelow(50)}."
                                   f"{secrets.randbelow(250)}.0/24")  # fmt: skip
        if len(names) + 2 > net.num_addresses:
            raise ValueError(f"{net} is too small for {len(names)} hosts")
        addrs = list(net.hosts())
        self.prefixlen = net.prefixlen
        self.gateway = str(addrs[0])  # the bench's own address, on the switch's uplink
        self.switch = f"sr1-{self.tag}-switch"  # the bridge's namespace
        self.bridge = f"sr1b{self.tag}"
        self.uplink = f"sr1g{self.tag}"  # the root namespace's port on the switch
        self.table = f"sr1_{self.tag}"
        self.hosts = {
            n: Host(n, f"sr1-{self.tag}-{n}", str(addrs[i + 1])) for i, n in enumerate(names)
        }
        self._made: list[str] = []  # namespaces made so far: down() removes exactly these
        self.cuts: set[tuple[str, str]] = set()

    def address(self, name: str) -> str:
        return self.hosts[name].address

    def exec_prefix(self, name: str) -> list[str]:
        """Prepend to a command to run it on host `name` (`ip netns exec` keeps the pid)."""
        return ["ip", "netns", "exec", self.hosts[name].netns]

    def up(self) -> HostNetwork:
        why = missing()
        if why:
            raise RuntimeError(f"cannot make hosts: {why}")
        sw = ("ip", "-n", self.switch)
        try:
            _run("ip", "netns", "add", self.switch)
            self._made.append(self.switch)
            _run(*sw, "link", "add", self.bridge, "type", "bridge")
            _run(*sw, "link", "set", self.bridge, "up")
            ports = [(self.uplink, None)]
            ports += [(f"sr1p{self.tag}{i}", h) for i, h in enumerate(self.hosts.values())]
            port = f"sr1s{self.tag}"  # each pair's switch end, renamed once it is there
            for end, host in ports:  # a veth pair: `end` stays here, its peer joins the switch
                _run("ip", "link", "add", end, "type", "veth", "peer", "name", port)
                _run("ip", "link", "set", port, "netns", self.switch)
                _run(*sw, "link", "set", port, "name", end)  # unique there, like its peer here
                _run(*sw, "link", "set", end, "master", self.bridge)
                _run(*sw, "link", "set", end, "up")
                if host is None:
                    _run("ip", "addr", "add", f"{self.gateway}/{self.prefixlen}", "dev", end)
                    _run("ip", "link", "set", end, "up")
                    continue
                _run("ip", "netns", "add", host.netns)
                self._made.append(host.netns)
                _run("ip", "link", "set", end, "netns", host.netns)
                ns = ("ip", "-n", host.netns)
                _run(*ns, "link", "set", end, "name", IFNAME)
                _run(*ns, "addr", "add", f"{host.address}/{self.prefixlen}", "dev", IFNAME)
                _run(*ns, "link", "set", IFNAME, "up")
                _run(*ns, "link", "set", "lo", "up")
            self._nft("add", "table", "bridge", self.table)
            self._nft("add", "chain", "bridge", self.table, "forward",
                      "{ type filter hook forward priority 0; policy accept; }")  # fmt: skip
        except BaseException:
            self.down()
            raise
        return self

    def _nft(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.switch, "nft", *args)

    def cut(self, a: str, b: str, *, oneway: bool = False) -> None:
        """Drop every packet from `a` to `b` (and back, unless `oneway`) at the switch."""
        pairs = [(a, b)] if oneway else [(a, b), (b, a)]
        for src, dst in pairs:
            if (src, dst) in self.cuts:
                continue
            match = ("ip", "saddr", self.address(src), "ip", "daddr", self.address(dst))
            self._nft("add", "rule", "bridge", self.table, "forward", *match, "drop")
            self.cuts.add((src, dst))

    def heal(self) -> None:
        """Every cut undone."""
        self._nft("flush", "chain", "bridge", self.table, "forward")
        self.cuts.clear()

    def down(self) -> None:
        """Remove the hosts and the switch (its rules with it); safe to call twice or after a
        failed up()."""
        for netns in self._made:  # deleting a namespace deletes its veth pairs and rules too
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True)
        self._made.clear()
        subprocess.run(["ip", "link", "delete", self.uplink], capture_output=True)
        self.cuts.clear()

    def __enter__(self) -> HostNetwork:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
