"""One-GPU smoke run of the bytescale backend's CUDA path, from init to interpreter exit (the
place where teardown-order bugs show): world collectives, a dynamic group, ring attention of
one, destroy_process_group. Run it under cuda-gdb to get a native backtrace of a crash."""
import argparse

argparse.ArgumentParser(description=__doc__).parse_args()  # --help only; runs on cuda:0

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import bytescale  # noqa: E402
from bytescale.attention import ring_attention  # noqa: E402

dist.init_process_group("bytescale", store=dist.HashStore(), rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
x = torch.ones(8, device="cuda")
g = bytescale.dynamic_group([0])
dist.all_reduce(x, group=g)
dist.all_reduce(x)
q = torch.randn(300, 4, 64, device="cuda", dtype=torch.bfloat16)
out = ring_attention(q, q[:, :2], q[:, :2], [300], [0])
torch.cuda.synchronize()
dist.destroy_process_group()
print("smoke ok", x.sum().item(), out.shape)
