"""A network namespace joined to this host by a veth pair: a test host with no route out.

The sglang-router tries to download a tokenizer from the model hub when it admits a
worker. Inside this namespace it can reach our emulated workers over the veth link
and nothing else, so a test can never send traffic off the machine.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class TestHost:
    name: str
    host_ip: str  # this side of the veth pair
    ns_ip: str  # the namespace's side
    link: str  # this side's veth device

    def exec_args(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def create(tag: str) -> TestHost:
    """Make namespace `fed<tag><pid>` and a /30 link to it (raises if `ip netns` is not allowed)."""
    name = f"fed{tag}{os.getpid() % 100000}"
    octet = os.getpid() % 250 + 1
    outer, inner = f"vh{name}"[:15], f"vn{name}"[:15]
    host = TestHost(name, f"10.213.{octet}.1", f"10.213.{octet}.2", outer)
    outer, inner = f"vh{name}"[:15], f"vn{name}"[:15]
    _ip("netns", "add", name)
    try:
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", name)
        _ip("addr", "add", f"{host.host_ip}/30", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{host.ns_ip}/30", "dev", inner)
        _ip("netns", "exec", name, "ip", "link", "set", inner, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
    except subprocess.CalledProcessError:
        destroy(host)
        raise
    return host


def destroy(host: TestHost) -> None:
    """Remove the namespace and both ends of the veth pair."""
    subprocess.run(["ip", "link", "del", host.link], check=False, capture_output=True)
    subprocess.run(["ip", "netns", "del", host.name], check=False, capture_output=True)
