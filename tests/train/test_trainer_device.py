"""Which GPU a training process takes (bytescale.train.trainer.cuda_device_index): one per process
on NCCL; on the staged transport several processes share the GPUs (the staged demo runs two
processes on one GPU, where `cuda:LOCAL_RANK` would be an invalid device ordinal for rank 1)."""
from __future__ import annotations

import pytest

from bytescale.train.config import ConfigError
from bytescale.train.trainer import cuda_device_index


def test_staged_processes_share_the_visible_gpus():
    assert [cuda_device_index(r, 1, "staged") for r in range(3)] == [0, 0, 0]
    assert [cuda_device_index(r, 2, "staged") for r in range(5)] == [0, 1, 0, 1, 0]


def test_nccl_takes_one_gpu_per_process_and_names_what_is_missing():
    assert [cuda_device_index(r, 4, "nccl") for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="LOCAL_RANK 1 but only 1 CUDA device.*staged"):
        cuda_device_index(1, 1, "nccl")
    with pytest.raises(ConfigError, match="no CUDA device"):
        cuda_device_index(0, 0, "staged")
