"""One rank of a tiny DeepSpeed ZeRO training run on CPU (gloo) that saves two checkpoints: run by
tests/test_deepspeed.py as ``python deepspeed_train.py STAGE DTYPE OUT`` with torch.distributed's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set for each rank.

The model has what a consolidation must get right: odd sizes (a partition boundary inside a parameter, ZeRO-3's
padding), a frozen layer, a float and an int64 buffer, and a head tied to the embedding."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402,F401
import torch  # noqa: E402

# DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (a minute of C++) when it can; gloo does the job.
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(37, 13)
        self.mid = torch.nn.Linear(13, 11)
        self.frozen = torch.nn.Linear(11, 7)
        self.norm = torch.nn.LayerNorm(7)
        self.up = torch.nn.Linear(7, 13, bias=False)
        self.head = torch.nn.Linear(13, 37, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(5, dtype=torch.float32) / 3)
        self.register_buffer("position_ids", torch.arange(9))
        for parameter in self.frozen.parameters():
            parameter.requires_grad = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.up(self.norm(self.frozen(self.mid(self.embed(tokens)))))
        return self.head(hidden).float().logsumexp(-1).mean() * self.scale.sum()


def main(stage: int, dtype: str, out: str) -> None:
    torch.manual_seed(0)
    model = Tiny()
    config: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, model_parameters=trained)
    torch.manual_seed(1 + engine.global_rank)
    for _ in range(2):
        loss = engine(torch.randint(0, 37, (2, 5)))
        engine.backward(loss)
        engine.step()
        # global_step1/, global_step2/, latest; universal_checkpoint_info (as Megatron-DeepSpeed saves it) is what
        # ds_to_universal asks of a checkpoint it converts
        engine.save_checkpoint(out, client_state={"universal_checkpoint_info": {}})


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
