"""Running one model over several processes: joining the process group `mlx.launch` started
(mx.distributed: the ring backend over TCP, JACCL over RDMA, NCCL on CUDA), and what a rank
says when another one is gone.

Every rank runs the same command on the same inputs (SPMD): each holds its share of the
weights (mlx_engine/shard.py), the collectives in its graph meet their partners, and the
logits every rank samples from are the same, so every rank picks the same tokens. Rank 0
alone prints.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from fuselm.runtime_metal.errors import RuntimeUserError

MODES = ("tensor", "pipeline")
_LAUNCH = "mlx.launch -n 2 --backend ring -- fuselm ..."


@dataclass(frozen=True)
class Parallel:
    mode: str
    rank: int
    size: int

    def describe(self) -> str:
        return f"{self.mode} parallel, rank {self.rank} of {self.size}"


def join(mode: str) -> Parallel:
    """This process's rank in the group mlx.launch started (mx.distributed.init); refused
    when the process was not started as one of several ranks."""
    if mode not in MODES:
        raise RuntimeUserError(f"unknown --parallel {mode!r}; choose from {', '.join(MODES)}")
    import mlx.core as mx

    try:
        group = mx.distributed.init()
    except RuntimeError as e:
        raise RuntimeUserError(f"--parallel {mode}: cannot join the process group ({e})"
                               ) from None
    if group.size() < 2:
        raise RuntimeUserError(
            f"--parallel {mode} runs one model over several processes: start them with "
            f"`{_LAUNCH}` (this process is alone)")
    return Parallel(mode, group.rank(), group.size())


def quiet_followers(parallel: Parallel) -> None:
    """Ranks other than 0 print nothing on stdout: rank 0 speaks for the job."""
    if parallel.rank:
        sys.stdout.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def peer_lost(error: BaseException) -> bool:
    """Whether an MLX error means a collective lost its partner (a rank died)."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        text.startswith(f"[{backend}]") for backend in ("ring", "jaccl", "nccl"))


def peer_lost_message(error: BaseException) -> str:
    rank = os.environ.get("MLX_RANK", "?")
    return (f"rank {rank}: another rank of the distributed job stopped ({error}); the job "
            "ends here")


def broadcast_json(value: Any, rank: int) -> Any:
    """Rank 0's JSON value on every rank (the others pass None): two sums over the group, its
    length and its bytes, where only rank 0 adds non-zeros."""
    import mlx.core as mx
    import numpy as np

    data = np.frombuffer(json.dumps(value).encode(), np.uint8) if rank == 0 else None
    n = mx.distributed.all_sum(mx.array([0 if data is None else data.size], mx.int32)).item()
    mine = mx.zeros((n,), mx.int32) if data is None else mx.array(data.astype(np.int32))
    out = np.array(mx.distributed.all_sum(mine)).astype(np.uint8)
    return json.loads(out.tobytes())
