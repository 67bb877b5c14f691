"""One rank of a job that exits WITHOUT destroy_process_group while operations are in flight
(tests/comm/test_exit_without_destroy.py runs it): world and dynamic-group collectives, posted
sends and receives, one receive that never matches; some Work handles dropped, some kept. The
interpreter then finalizes while bytescale's and Gloo's threads still hold the ops' tensors."""
from __future__ import annotations

import datetime
import os
import random
import sys
import time

import torch
import torch.distributed as dist

import bytescale


def main(store_path: str, rank: int, world: int, seed: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("bytescale", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    rng = random.Random(seed * 31 + rank)
    peer = (rank + 1) % world
    src = (rank - 1) % world
    group = bytescale.dynamic_group(list(range(world))[::-1], cache=False)
    works = []
    for step in range(3):
        x = torch.randn(1 << 16)
        works.append(dist.all_reduce(x, async_op=True))
        works.append(dist.all_reduce(torch.randn(1 << 15), group=group, async_op=True))
        works.append(dist.isend(torch.randn(1 << 14), peer))
        works.append(dist.irecv(torch.empty(1 << 14), src))
        if rng.random() < 0.5:
            works[-1].wait()
    if rank == 0:
        works.append(dist.irecv(torch.empty(8), src, tag=7))  # never sent: in flight at exit
    time.sleep(rng.random() * 0.05)
    keep = works[::2]  # the others' last references go now, the kept ones at finalization
    del works
    sys.stdout.write(f"rank {rank}: exiting with {len(keep)} works held\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    # no destroy_process_group: the interpreter finalizes with the ops in flight
