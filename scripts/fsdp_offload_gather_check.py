"""Reproduces the torch 2.14 CPU bug that `diffalign.runtime.distributed.CheckpointOptimizer` avoids: FSDP1's full
optimizer-state gather with ``offload_to_cpu=True`` returns Adam's ``exp_avg`` equal to ``exp_avg_sq`` (2 gloo
processes, a 2-layer model with one frozen weight, 2 AdamW steps). Prints, per parameter and setting, whether the two
moments are equal. Run: ``OMP_NUM_THREADS=1 python scripts/fsdp_offload_gather_check.py``."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def run(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model[0].weight.requires_grad_(False)
    wrapped = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        wrapped(torch.randn(4, 8)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    for offload in (True, False):
        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=offload, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=False)):
            state = FSDP.optim_state_dict(wrapped, optimizer)["state"]
        if rank == 0:
            for name, s in state.items():
                print(f"torch {torch.__version__} offload_to_cpu={offload} {name}: exp_avg == exp_avg_sq: "
                      f"{torch.equal(s['exp_avg'], s['exp_avg_sq'])}")
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(run, args=(free,), nprocs=2)
