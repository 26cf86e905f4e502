"""The rank processes of tests/test_expert_dispatch.py. They live apart from the test module
because a spawned rank imports the module that holds its function: this one imports torch and
the MoE layer only, not the test module's transformers, pytest and test helpers (about 1 s less
for each of the file's 13 ranks on the 2-core machine). The parent hands each rank the whole
layer's weights, its config and the tokens, so both sides compute from the same tensors."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine_core.config import ModelConfig
from engine_core.models.moe import Router, Routing, SparseMoE, route
from engine_core.parallel import TPGroup, connect_store, create_store

# The whole layer's router weight [E, H], gate/up projections [E, 2I, H], down projections
# [E, H, I]: what every rank copies its share from.
WholeWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def rank_layer(config: ModelConfig, whole: WholeWeights, tp: TPGroup) -> SparseMoE:
    """Rank tp.rank's layer: the router, and its experts whole, copied from ``whole``."""
    gate, w13, w2 = whole
    layer = SparseMoE(config, tp)
    local = layer.w13.shape[0]
    mine = slice(layer.first_expert, layer.first_expert + local)
    with torch.no_grad():
        layer.gate.weight.copy_(gate)
        layer.w13.copy_(w13[mine])
        layer.w2.copy_(w2[mine])
    return layer


def record_received(layer: SparseMoE) -> list[torch.Tensor]:
    """Wrap the layer's local experts so that each call's rows per local expert are kept."""
    seen: list[torch.Tensor] = []
    run = layer.run_local_experts

    def recording(rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        seen.append(torch.bincount(experts, minlength=layer.w13.shape[0]))
        assert rows.shape[0] == experts.shape[0]
        return run(rows, experts)

    layer.run_local_experts = recording  # type: ignore[method-assign]
    return seen


def to_rank_zero(layer: SparseMoE) -> Router:
    """A router that moves the layer's top-k onto rank 0's experts (id mod L)."""
    local = layer.w13.shape[0]

    def routed(x: torch.Tensor) -> Routing:
        weights, ids = route(layer.gate(x), layer.top_k, True)
        return x, weights, ids % local

    return routed


def rank_main(
    rank: int, size: int, config: ModelConfig, whole: WholeWeights, x: torch.Tensor,
    to_zero: bool, folder: str, device_type: str, port: int,
) -> None:  # fmt: skip
    """One process: join the group (gloo on the CPU, NCCL on GPU ``rank``), run the rank's layer
    on the replicated tokens, save its output and the rows its experts received."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = connect_store(port, size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    try:
        world = dist.group.WORLD
        tp = TPGroup(rank, size, device_group=world, expert_parallel=True, world_group=world)
        layer = rank_layer(config, whole, tp).to(device)
        seen = record_received(layer)
        with torch.no_grad():
            x = x.to(device)
            out = layer.routed_output(x, to_rank_zero(layer)) if to_zero else layer(x)
        received = torch.stack(seen).sum(0) if seen else torch.zeros(layer.w13.shape[0])
        result = {"out": out.cpu(), "received": received.long().cpu()}
        torch.save(result, f"{folder}/rank{rank}.pt")
        dist.barrier()  # no rank leaves while another still talks to it
    except BaseException:
        dist.destroy_process_group()
        raise
    # Its result saved, the rank leaves without gloo's teardown, which now and then aborted a
    # rank whose peer tore down at the same moment ("terminate called without an active
    # exception", a SIGABRT that failed the test after every check had passed).
    os._exit(0)


def run_ranks(
    size: int, config: ModelConfig, whole: WholeWeights, x: torch.Tensor, folder: Path,
    to_zero: bool = False, device_type: str = "cpu",
) -> list[dict]:  # fmt: skip
    store = create_store(size)  # the engine's rendezvous, held here: it outlives every rank
    args = (size, config, whole, x, to_zero, str(folder), device_type, store.port)
    mp.spawn(rank_main, args=args, nprocs=size)
    return [torch.load(folder / f"rank{r}.pt") for r in range(size)]
