"""Two hosts on one machine: a network namespace joined to this one by a veth link.

Loopback skips the network stack's device layer; a veth pair between namespaces goes
through it (qdisc, device queues, the peer's receive path), as a real NIC would short of
the wire. A server started with `prefix()` runs in the namespace; clients reach it at
`server_ip`. Needs root and iproute2 (`ip netns`); `VethLink.available()` says why not
where it cannot be made (containers without CAP_NET_ADMIN, no iproute2).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@dataclass
class VethLink:
    """`with VethLink("dlrm-srv") as link:` creates namespace `name` with address
    `server_ip`/24 on one end of a veth pair and `client_ip`/24 on the other end, here."""

    name: str = "dlrm-lab-srv"
    server_ip: str = "10.231.0.1"
    client_ip: str = "10.231.0.2"

    @staticmethod
    def available() -> str | None:
        """None when a namespace can be made here, else why not (one line)."""
        if shutil.which("ip") is None:
            return "no `ip` command (install iproute2)"
        if os.geteuid() != 0:
            return "creating network namespaces needs root"
        probe = _ip("netns", "add", "dlrm-lab-probe")
        if probe.returncode != 0:
            return f"`ip netns add` refused: {probe.stderr.strip() or probe.returncode}"
        _ip("netns", "del", "dlrm-lab-probe")
        return None

    @property
    def host_if(self) -> str:
        return f"{self.name[:8]}-h"

    @property
    def ns_if(self) -> str:
        return f"{self.name[:8]}-n"

    def prefix(self) -> list[str]:
        """Prepend to a command to run it inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def __enter__(self) -> VethLink:
        self.close()  # a namespace left by a killed run of ours
        steps = [
            ("netns", "add", self.name),
            ("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if),
            ("link", "set", self.ns_if, "netns", self.name),
            ("addr", "add", f"{self.client_ip}/24", "dev", self.host_if),
            ("link", "set", self.host_if, "up"),
            ("-n", self.name, "addr", "add", f"{self.server_ip}/24", "dev", self.ns_if),
            ("-n", self.name, "link", "set", self.ns_if, "up"),
            ("-n", self.name, "link", "set", "lo", "up"),
        ]
        for step in steps:
            out = _ip(*step)
            if out.returncode != 0:
                self.close()
                raise RuntimeError(f"ip {' '.join(step)}: {out.stderr.strip()}")
        return self

    def close(self) -> None:
        _ip("link", "del", self.host_if)  # deletes its peer too
        _ip("netns", "del", self.name)

    def __exit__(self, *exc: object) -> None:
        self.close()
