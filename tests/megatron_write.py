"""A Megatron-Core ``torch_dist`` checkpoint written by Megatron-Core's own ``dist_checkpointing.save`` from the ranks
of a tensor-parallel group on CPU (gloo): ``python megatron_write.py OUT`` in each rank's process, with
torch.distributed's environment. Each rank holds its rows of ``decoder.linear_fc1.weight`` and its columns of
``decoder.linear_fc2.weight`` (odd widths), the embedding is replicated, each rank's RNG state is a
``ShardedObject``, and the plain values (``iteration``, a loss scale) go to ``common.pt``. The full tensors are the
ones ``expected()`` makes."""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist


def expected() -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors the ranks save pieces of."""
    return {
        "decoder.linear_fc1.weight": torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) / 7,
        "decoder.linear_fc2.weight": torch.arange(5 * 10, dtype=torch.float32).reshape(5, 10) - 20,
        "embedding.word_embeddings.weight": torch.arange(10 * 3, dtype=torch.bfloat16).reshape(10, 3),
    }


def main(out: str) -> None:
    warnings.simplefilter("ignore")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    # CPU only: Megatron-Core synchronises and places its flags on the current CUDA device
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    full = expected()
    fc1 = full["decoder.linear_fc1.weight"].chunk(world, dim=0)[rank].clone()
    fc2 = full["decoder.linear_fc2.weight"].chunk(world, dim=1)[rank].clone()
    embedding = full["embedding.word_embeddings.weight"]
    state = {
        "decoder.linear_fc1.weight": ShardedTensor.from_rank_offsets(
            "decoder.linear_fc1.weight", fc1, (0, rank, world)
        ),
        "decoder.linear_fc2.weight": ShardedTensor.from_rank_offsets(
            "decoder.linear_fc2.weight", fc2, (1, rank, world)
        ),
        "embedding.word_embeddings.weight": ShardedTensor.from_rank_offsets(
            "embedding.word_embeddings.weight", embedding, replica_id=rank
        ),
        "rng_state": ShardedObject("rng_state", {"seed": 1234 + rank}, (world,), (rank,)),
        "iteration": 100,
        "loss_scale": torch.tensor([2.0, 4.0]),
    }
    dist_checkpointing.save(state, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # Megatron-Core's writer starts processes of its own
    main(sys.argv[1])
