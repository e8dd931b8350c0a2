"""meshsplit holds no more memory than what it replaces: Plan() than plain PyTorch, Plan(dp=2)
than DDP per rank, counted from before the model is built by a counter that is not meshsplit's.

The model is a small LM whose logits dominate (vocab 4096): a step that keeps one logits-sized
tensor alive over backward, or gradients a lone replica does not need, shows at once.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

import meshsplit as ms

LM = {"vocab_size": 4096, "d_model": 64, "n_heads": 4, "n_layers": 2, "seq_len": 32}
LIMIT = 1.03


class _Peak(TorchDispatchMode):
    """Peak bytes of the live CPU storages that ops created since it was entered."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                storage = value.untyped_storage()
                if id(storage) not in self.live:
                    self.live[id(storage)] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._freed, id(storage))
        return out

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, LM["vocab_size"], (8, LM["seq_len"] + 1), generator=torch.Generator())
    return tokens[:, :-1], tokens[:, 1:]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _meshsplit(plan: ms.Plan) -> int:
    x, y = _batch()
    with _Peak() as counter:
        model = ms.models.transformer(**LM)
        engine = ms.parallelize(
            model, plan, optimizer=_adamw, loss_fn=ms.models.TokenCrossEntropy()
        )
        for _ in range(3):
            engine.train_step(x, y)
    engine.close()
    return counter.peak


def _plain(replicas: int) -> int:
    x, y = _batch()
    rank = dist.get_rank() if replicas > 1 else 0
    with _Peak() as counter:
        model = ms.models.transformer(**LM)
        if replicas > 1:
            model = DistributedDataParallel(model)
        optimizer, loss_fn = _adamw(model.parameters()), ms.models.TokenCrossEntropy()
        for _ in range(3):
            optimizer.zero_grad()
            loss_fn(model(x.chunk(replicas)[rank]), y.chunk(replicas)[rank]).backward()
            optimizer.step()
    return counter.peak


def _both(replicas: int) -> tuple[int, int]:
    return _meshsplit(ms.Plan(dp=replicas)), _plain(replicas)


def test_one_process_holds_what_plain_pytorch_holds() -> None:
    [(ours, plain)] = ms.launch(_both, 1, args=(1,), backend="gloo")
    assert ours <= LIMIT * plain, (ours, plain)


def test_data_parallel_holds_what_ddp_holds_per_rank() -> None:
    for ours, ddp in ms.launch(_both, 2, args=(2,)):
        assert ours <= LIMIT * ddp, (ours, ddp)
