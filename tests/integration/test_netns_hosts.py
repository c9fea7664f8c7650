"""harness/netns.py: hosts of their own joined by a bridge, and partitions at its switch."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.netns import HostNetwork, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"netns hosts: {missing()}")

# Echoes each line back, on the host's own address (not loopback).
ECHO = """
import socketserver, sys
class Echo(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(line)
socketserver.ThreadingTCPServer.daemon_threads = True
server = socketserver.ThreadingTCPServer((sys.argv[1], 7070), Echo)
print("up", flush=True)
server.serve_forever()
"""

# From host a: connect to b, send one line, print what came back or the error's name.
PING = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], 7070), timeout=float(sys.argv[2]))
    c.sendall(b"hi\\n")
    print(c.recv(16).decode().strip())
except OSError as e:
    print(type(e).__name__)
"""


def _from(net: HostNetwork, host: str, code: str, *args: str) -> str:
    cmd = [*net.exec_prefix(host), sys.executable, "-c", code, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()


@pytest.fixture
def net():
    network = HostNetwork(["a", "b"]).up()
    server = subprocess.Popen(
        [*network.exec_prefix("b"), sys.executable, "-c", ECHO, network.address("b")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "up"
    yield network
    server.kill()
    server.wait()
    network.down()


def test_hosts_reach_each_other_on_their_own_addresses_and_not_on_loopback(net) -> None:
    assert _from(net, "a", PING, net.address("b"), "2") == "hi"
    # b's server is not on a's loopback: each host has its own.
    assert _from(net, "a", PING.replace("sys.argv[1]", "'127.0.0.1'"), "x", "2") != "hi"
    # The bench (root namespace) reaches a host through the bridge.
    with socket.create_connection((net.address("b"), 7070), timeout=2) as c:
        c.sendall(b"x\n")
        assert c.recv(4) == b"x\n"


BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")


@pytest.fixture
def host_firewall_drops_forwarding():
    """What dockerd does to this machine: br_netfilter on (bridged packets meet the IP
    firewall) and the forward hook's policy drop, here as a table of the test's own."""
    if shutil.which("modprobe"):
        subprocess.run(["modprobe", "br_netfilter"], capture_output=True)
    if not BRIDGE_NF.exists():
        pytest.skip("no br_netfilter here: bridged packets never meet the IP firewall")
    was = BRIDGE_NF.read_text()
    BRIDGE_NF.write_text("1\n")
    table = "sr1_test_fw"
    subprocess.run(["nft", "add", "table", "ip", table], check=True)
    subprocess.run(
        ["nft", "add", "chain", "ip", table, "forward",
         "{ type filter hook forward priority 0; policy drop; }"],
        check=True,
    )  # fmt: skip
    yield
    subprocess.run(["nft", "delete", "table", "ip", table], check=True)
    BRIDGE_NF.write_text(was)


def test_a_host_firewall_that_drops_forwarding_does_not_part_the_hosts(
    host_firewall_drops_forwarding, net
) -> None:
    """The switch lives in a namespace of its own: a firewall on this machine (Docker's) is
    not on the hosts' path, which before silenced every host once dockerd ran (CI)."""
    assert _from(net, "a", PING, net.address("b"), "2") == "hi"
    with socket.create_connection((net.address("b"), 7070), timeout=2) as c:
        c.sendall(b"x\n")
        assert c.recv(4) == b"x\n"


def test_a_cut_is_silence_both_ways_until_healed(net) -> None:
    open_conn = socket.create_connection((net.address("b"), 7070), timeout=2)
    net.cut("a", "b")
    assert _from(net, "a", PING, net.address("b"), "1.5") == "TimeoutError"  # no refusal
    net.heal()
    assert _from(net, "a", PING, net.address("b"), "2") == "hi"
    open_conn.close()


def test_a_one_way_cut_drops_only_one_direction(net) -> None:
    net.cut("b", "a", oneway=True)  # b's answers to a vanish: a's SYN arrives, its SYN-ACK not
    assert _from(net, "a", PING, net.address("b"), "1.5") == "TimeoutError"
    # The bench is not a: it still reaches b both ways.
    with socket.create_connection((net.address("b"), 7070), timeout=2) as c:
        c.sendall(b"y\n")
        assert c.recv(4) == b"y\n"
    net.heal()
    assert _from(net, "a", PING, net.address("b"), "2") == "hi"


def test_an_established_connection_stays_open_and_silent_across_a_cut(net) -> None:
    server_b = net.address("b")
    code = f"""
import socket, time
c = socket.create_connection(("{server_b}", 7070), timeout=2)
c.sendall(b"1\\n"); print(c.recv(8).decode().strip(), flush=True)
input()  # the cut is made now
c.settimeout(1.5); c.sendall(b"2\\n")
try:
    print(c.recv(8).decode().strip(), flush=True)
except OSError as e:
    print(type(e).__name__, flush=True)
input()  # healed: the retransmission delivers the held line
c.settimeout(10); print(c.recv(8).decode().strip(), flush=True)
"""
    proc = subprocess.Popen(
        [*net.exec_prefix("a"), sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "1"
    net.cut("a", "b")
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "TimeoutError"
    net.heal()
    time.sleep(0.1)
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "2"
    proc.wait(10)


def test_down_removes_every_namespace_and_the_bridge() -> None:
    network = HostNetwork(["x", "y"]).up()
    names = [h.netns for h in network.hosts.values()] + [network.switch]
    network.cut("x", "y")
    network.down()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert network.uplink not in links and network.tag not in links
    network.down()  # twice is harmless
