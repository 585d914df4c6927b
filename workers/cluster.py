"""Worlds that span machines: launch groups started by torchrun join the driver's pool.

On one machine the driver starts every worker itself (launch.py). Across
machines it cannot, so the workers are started by torch's own launcher, one
launch group per machine, all with the same static rendezvous
(`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`): torchrun gives
every worker its RANK / WORLD_SIZE / LOCAL_RANK and the MASTER_ADDR/PORT that
`init_process_group("env://")` uses. The driver launches group 0 on its own
machine itself (so rank 0, which returns results through shared memory, sits
next to the driver) and waits for the others; `Cluster.join_command(n)` is the
command to run on machine n.

Control: every worker connects back to the driver over TCP (`control`), and the
same HMAC challenge as on one machine gates it: the key lives in a 0600 file
that the user copies to the other machines (like an ssh key); a file readable by
others is refused. Messages stay JSON, so nothing a peer sends is unpickled.

Tensors: another machine cannot map the driver's /dev/shm, so in a cluster
world rank 0 reads each job's tensors and broadcasts them over the
torch.distributed world (raw bytes, any dtype); weights travel the same way
once per model. Results come back from rank 0, on the driver's machine, as usual.
"""
from __future__ import annotations

import os
import shlex
import socket
import stat
import sys
from dataclasses import dataclass

from .bootstrap import pack_root
from .protocol import new_authkey


class ClusterError(ValueError):
    """A cluster description that cannot work; the message says what to change."""


@dataclass(frozen=True)
class Cluster:
    nnodes: int                   # launch groups (machines), the driver's own included
    nproc_per_node: int           # workers per launch group
    authkey_file: str             # 0600 file with the hex key; created here when missing
    control: str = "127.0.0.1:0"  # host:port where workers reach the driver (0 = any free port)
    master_addr: str = "127.0.0.1"  # torch.distributed rendezvous host: this machine
    master_port: int = 29500

    def __post_init__(self):
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise ClusterError(f"nnodes ({self.nnodes}) and nproc_per_node ({self.nproc_per_node}) must be >= 1")
        host, _, port = self.control.rpartition(":")
        if not host or not port.isdigit():
            raise ClusterError(f"control must be host:port (port 0 = any free port), got {self.control!r}")
        if not 0 < int(self.master_port) < 65536:
            raise ClusterError(f"master_port must be a TCP port, got {self.master_port}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def check_world(self, config) -> None:
        if config.world_size != self.world_size:
            raise ClusterError(f"the parallel config needs {config.world_size} workers ({config.describe()}) but "
                               f"the cluster has nnodes {self.nnodes} x nproc_per_node {self.nproc_per_node} = "
                               f"{self.world_size}; change the degrees or the cluster")

    def authkey(self) -> bytes:
        """The shared key, made (0600) on first use; refused when other users could read it."""
        path = self.authkey_file
        if not os.path.exists(path):
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(new_authkey().hex() + "\n")
        return read_authkey_file(path)

    def join_command(self, node_rank: int, control: str | None = None, python: str = sys.executable) -> list:
        """The torchrun command that starts launch group `node_rank` (run it on that machine)."""
        if not 0 <= node_rank < self.nnodes:
            raise ClusterError(f"node_rank must be in [0, {self.nnodes}), got {node_rank}")
        return [python, "-m", "torch.distributed.run", f"--nnodes={self.nnodes}", f"--node-rank={node_rank}",
                f"--nproc-per-node={self.nproc_per_node}", f"--master-addr={self.master_addr}",
                f"--master-port={self.master_port}", "--max-restarts=0",
                str(pack_root() / "workers" / "torchrun_entry.py"),
                "--driver", control or self.control, "--authkey-file", os.path.abspath(self.authkey_file)]


def read_authkey_file(path: str) -> bytes:
    st = os.stat(path)
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ClusterError(f"{path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                           f"chmod 600 it: anyone holding the key can drive the workers")
    with open(path) as f:
        line = f.read().strip()
    if len(line) != 64:
        raise ClusterError(f"{path} must hold a 32-byte hex key (64 characters), got {len(line)} characters")
    return bytes.fromhex(line)


def bind_control(cluster: Cluster) -> socket.socket:
    host, _, port = cluster.control.rpartition(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, int(port)))
    s.listen(128)
    return s


class PeerHandle:
    """Stands in for a Popen of a worker the driver did not start (torchrun did): pid and liveness
    where it is on this machine; a worker elsewhere is known dead only when its channel closes."""

    def __init__(self, pid: int, local: bool):
        self.pid, self.local, self.returncode = pid, local, None

    def poll(self):
        if self.returncode is None and self.local:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = "gone"
            except PermissionError:
                pass
        return self.returncode

    def wait(self, timeout=None):
        return self.poll()

    def kill(self):
        if self.local and self.poll() is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


def join_commands(cluster: Cluster) -> list:
    """One shell line per other machine: copy the key there first (mode 600), then run it."""
    control = cluster.control
    return [shlex.join(cluster.join_command(n, control=control)) for n in range(1, cluster.nnodes)]


def default_key_file() -> str:
    """Where the shared key lives unless the node names a file: the user's home, in a 0700 folder."""
    folder = os.path.join(os.path.expanduser("~"), ".hybrid_parallel")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return os.path.join(folder, "cluster.key")


class NodeCluster:
    """What flows along a HP_CLUSTER wire: the cluster (from the Parallel Cluster node) and how long a prompt waits for it to assemble."""

    def __init__(self, cluster: Cluster, join_timeout_s: float):
        self.cluster, self.join_timeout_s = cluster, join_timeout_s

    def __eq__(self, other):
        return isinstance(other, NodeCluster) and (self.cluster, self.join_timeout_s) == (other.cluster,
                                                                                           other.join_timeout_s)

    def __hash__(self):
        return hash((self.cluster, self.join_timeout_s))

    def describe(self) -> list:
        c = self.cluster
        lines = [f"{c.nnodes} machine(s) x {c.nproc_per_node} worker(s); this machine runs launch group 0",
                 f"key: {c.authkey_file} (copy it to every machine, mode 600)",
                 "on each other machine run (it expects this pack, Python and the key at the same paths; edit "
                 "them where they differ):"]
        lines += [f"machine {n}: {cmd}" for n, cmd in enumerate(join_commands(c), start=1)]
        return lines
