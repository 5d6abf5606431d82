"""How fserver_lib's launch variables become mesh options: this process's
role, group size, instance and rank (StepMesh's rules), and the options of one
role in one mesh of a group (its scheduler on port + instance). Part of
:mod:`stepmesh.fserver`."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import stepmesh

# Every variable is read by the one environment table (src/core/env.cc):
# MeshOptions.from_env() gives the DMLC_* / STEPMESH_* settings, the fserver_lib
# launch ones in its fserver_* fields. This module reads no environment itself.

def _launch() -> Tuple[stepmesh.MeshOptions, Dict[str, Any]]:
    """The options of the environment and what fserver_lib derives from them."""
    opts = stepmesh.MeshOptions.from_env()
    role = opts.fserver_role or "server"  # fserver_lib's default role
    g = opts.fserver_group_size
    instance = opts.fserver_instance_id
    if instance < 0:
        instance = opts.fserver_gpu + opts.fserver_rank_offset
    if g > 1 and not 0 <= instance < g:
        raise ValueError(f"instance {instance} (DMLC_INSTANCE_ID, else STEPMESH_GPU + "
                         f"DMLC_RANK_OFFSET) is outside DMLC_GROUP_SIZE={g}")
    # StepMesh's rank rule: DMLC_NODE_RANK * DMLC_GROUP_SIZE + STEPMESH_GPU + DMLC_RANK_OFFSET.
    # With DMLC_GROUP_SIZE > 1, instance i of every group forms its own mesh
    # (GPU i talks to GPU i), in which the group's rank is the rank.
    rank = opts.fserver_node_rank if g > 1 else (
        opts.fserver_node_rank + opts.fserver_gpu + opts.fserver_rank_offset)
    return opts, {"role": role, "group_size": g, "instance": instance, "rank": rank}


def _scheduler_port(address: str) -> int:
    host, _, port = address.rpartition(":")
    return int(port)


def _instance_options(opts: stepmesh.MeshOptions, role: str, launch: Dict[str, Any],
                      instance: int, port: Optional[int] = None) -> stepmesh.MeshOptions:
    """The options of `role` in mesh `instance` (its scheduler on port + instance)."""
    changes: Dict[str, Any] = {"role": role}
    base = _scheduler_port(opts.scheduler) if port is None else port  # `port`: the one bound
    offset = instance if launch["group_size"] > 1 else 0
    if base != 0 and (offset or port is not None):
        host = opts.scheduler.rpartition(":")[0]
        changes["scheduler"] = f"{host}:{base + offset}"
    if role != "scheduler" and opts.rank < 0:  # STEPMESH_RANK, when set, wins
        changes["rank"] = launch["rank"]
    return opts.copy(**changes)
