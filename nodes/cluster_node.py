"""Hybrid Parallel Cluster node: the machines a world spans -> CLUSTER, for Parallel Config's `cluster` input.

Why a node of its own: a cluster is set up once per set of machines, while degrees change per workflow;
and its output text is what a user needs at the other machines - the exact command each one runs to join
(workers/cluster.py: torchrun launch groups, a shared 0600 key, the driver's TCP control port). The ports
are fixed here (not "any free port") so that command stays valid across pool restarts.
"""
from __future__ import annotations

import os

from ..workers.cluster import Cluster, ClusterError, NodeCluster, default_key_file


class ClusterNode:
    DESCRIPTION = ("Spread a Parallel Config's world over several machines. This machine runs launch group 0 (rank "
                   "0 stays next to ComfyUI); every other machine joins by running the command this node prints, "
                   "with a copy of the key file. Connect to Parallel Config's `cluster` input.")
    CATEGORY = "Hybrid Parallel/advanced"
    RETURN_TYPES = ("HP_CLUSTER",)
    RETURN_NAMES = ("cluster",)
    OUTPUT_TOOLTIPS = ("Connect to Parallel Config.",)
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "nnodes": ("INT", {"default": 2, "min": 1, "max": 256, "tooltip": "Machines (launch groups), this "
                               "one included."}),
            "nproc_per_node": ("INT", {"default": 1, "min": 1, "max": 64, "tooltip": "Workers per machine (one per "
                                       "GPU). The degrees' product must equal nnodes x nproc_per_node."}),
            "address": ("STRING", {"default": "127.0.0.1", "tooltip": "This machine's address as the other "
                                   "machines reach it (torch.distributed rendezvous and the pack's control "
                                   "channel)."}),
            "control_port": ("INT", {"default": 29600, "min": 1, "max": 65535, "tooltip": "TCP port the workers "
                                     "connect back to (HMAC-authenticated)."}),
            "master_port": ("INT", {"default": 29500, "min": 1, "max": 65535, "tooltip": "torch.distributed "
                                    "rendezvous port."}),
        }, "optional": {
            "key_file": ("STRING", {"default": "", "tooltip": "0600 file with the shared key (created when missing; "
                                    "copy it to the other machines). Empty = ~/.hybrid_parallel/cluster.key."}),
            "join_timeout_s": ("INT", {"default": 300, "min": 5, "max": 3600, "tooltip": "How long a prompt waits "
                                       "for the other machines to join before failing with their commands."}),
        }}

    @staticmethod
    def configure(nnodes, nproc_per_node, address, control_port, master_port, key_file="",
                  join_timeout_s=300) -> "NodeCluster":
        address = (address or "").strip()
        if not address or any(c.isspace() for c in address) or ":" in address:
            raise ValueError(f"Hybrid Parallel Cluster: address must be a host name or IPv4 address the other "
                             f"machines reach this one at (no port), got {address!r}")
        if control_port == master_port:
            raise ValueError(f"Hybrid Parallel Cluster: control_port and master_port are both {control_port}; "
                             f"pick two different ports")
        try:
            cluster = Cluster(nnodes=int(nnodes), nproc_per_node=int(nproc_per_node),
                              authkey_file=os.path.abspath(os.path.expanduser(key_file.strip()))
                              if key_file and key_file.strip() else default_key_file(),
                              control=f"{address}:{int(control_port)}", master_addr=address,
                              master_port=int(master_port))
        except ClusterError as e:
            raise ValueError(f"Hybrid Parallel Cluster: {e}") from None
        return NodeCluster(cluster, float(join_timeout_s))

    def build(self, **widgets):
        nc = self.configure(**widgets)
        try:
            nc.cluster.authkey()  # made now (0600), so the user can copy it before the first prompt
        except (ClusterError, OSError) as e:
            raise ValueError(f"Hybrid Parallel Cluster: key file: {e}") from None
        return {"ui": {"text": nc.describe()}, "result": (nc,)}
