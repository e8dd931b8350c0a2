"""ms.Trainer: a plain script (no main guard, its own model class) trains on workers started
inside, gets the weights back, and is refused bad input before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import meshsplit as ms
from meshsplit.runtime import trainer as trainer_module
from meshsplit.runtime.training import epoch_order

SCRIPT = """
import copy, json, os, sys
import torch, torch.nn as nn
import meshsplit as ms
from meshsplit.runtime.training import epoch_order


class KerasMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.dense1, self.dense2 = nn.Linear(784, 1024), nn.Linear(1024, 512)
        self.dense3, self.out = nn.Linear(512, 256), nn.Linear(256, 10)

    def forward(self, x):
        x = torch.relu(self.dense1(self.flatten(x)))
        return self.out(torch.relu(self.dense3(torch.relu(self.dense2(x)))))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.Flatten(),
            nn.Linear(64 * 24 * 24, 128), nn.ReLU(), nn.Linear(128, 10),
        )

    def forward(self, x):
        return self.layers(x)


name, dp, pp, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
build = {"mlp": KerasMLP, "cnn": ConvNet}[name]
torch.manual_seed(0)
model = build()
start = copy.deepcopy(model.state_dict())
train, test = ms.data.digits("train"), ms.data.digits("test")

trainer = ms.Trainer(
    model, ms.Plan(dp=dp, pp=pp),
    optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
    loss_fn=nn.CrossEntropyLoss(),
)
history = trainer.fit(train, epochs=epochs, batch_size=64)
scores = trainer.evaluate(test)

alone = build()  # the same model, start and batches, trained in this one process
alone.load_state_dict(start)
optimizer = torch.optim.Adam(alone.parameters(), lr=1e-3)
for epoch in range(1, epochs + 1 if os.environ.get("RANK", "0") == "0" else 1):
    order = epoch_order(len(train[1]), 0, epoch)
    for index in range(len(order) // 64):
        picked = order[index * 64 : (index + 1) * 64]
        optimizer.zero_grad()
        nn.functional.cross_entropy(alone(train[0][picked]), train[1][picked]).backward()
        optimizer.step()
with torch.no_grad():
    single = (alone.eval()(test[0]).argmax(-1) == test[1]).float().mean().item()
    weights = float(sum(p.double().sum() for p in trainer.model.parameters()))
print("RESULT " + json.dumps({
    "accuracy": scores["accuracy"], "single": single, "epochs": len(history),
    "loss": history.history["loss"], "weights": weights, "rank": os.environ.get("RANK", "0"),
}))
"""


def _run(command: list[str], tmp_path: Path, timeout: int) -> tuple[str, list[dict]]:
    # as a user runs it: torch in the script uses every core before the workers fork
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS")
    }
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = [
        json.loads(line.removeprefix("RESULT "))
        for line in done.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    return done.stdout, results


@pytest.mark.parametrize(
    ("name", "dp", "pp", "epochs"),
    [("mlp", 2, 2, 2), ("cnn", 2, 1, 1)],
)
def test_plain_script_reaches_single_process_accuracy(tmp_path, name, dp, pp, epochs) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, str(script), name, str(dp), str(pp), str(epochs)]
    stdout, (result,) = _run(command, tmp_path, timeout=240)
    assert result["epochs"] == epochs
    assert "training" in stdout and f"epoch {epochs}/{epochs}" in stdout  # rank 0's report
    assert result["accuracy"] > 0.85
    # the plan trains as one process does: up to summation order, which moves a few test
    # samples at most; one point is 3.6 of the 359
    assert abs(result["accuracy"] - result["single"]) <= 0.01


ONE_WORKER = """
import torch, meshsplit as ms
big = torch.randn(1500, 1500)
for _ in range(3):
    big = torch.tanh(big @ big)  # a team of OpenMP threads in the caller, before the fork
torch.manual_seed(0)
model = ms.models.mlp((784, 64, 10))
trainer = ms.Trainer(model, ms.Plan())  # one worker, given every core
trainer.fit(ms.data.digits("test"), epochs=3, batch_size=32, verbose=0)
print("RESULT", trainer.evaluate(ms.data.digits("test"))["accuracy"])
"""


def test_one_worker_with_every_core_after_the_caller_used_them(tmp_path) -> None:
    """GNU OpenMP is not fork-safe: the worker runs on a fresh thread, so it does not wait
    for the caller's thread team (which fork did not copy)."""
    script = tmp_path / "one.py"
    script.write_text(ONE_WORKER)
    _, (accuracy,) = _run([sys.executable, str(script)], tmp_path, timeout=90)
    assert accuracy > 0.5


def test_plain_script_under_torchrun(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(script), "mlp", "2", "1", "1",
    ]  # fmt: skip
    _, results = _run(command, tmp_path, timeout=180)
    assert len(results) == 2  # every rank's own model holds the trained weights
    assert results[0]["weights"] == results[1]["weights"]
    assert results[0]["accuracy"] == results[1]["accuracy"]
    (first,) = [result for result in results if result["rank"] == "0"]  # its own baseline
    assert abs(first["accuracy"] - first["single"]) <= 0.01


def _small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return ms.models.mlp((784, 32, 16, 10))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _digits(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = ms.data.digits("train")
    return inputs[:samples], targets[:samples]


def _alone(
    train: tuple[torch.Tensor, torch.Tensor], epochs: int, autocast: torch.dtype | None = None
) -> nn.Module:
    """The small MLP trained in this process on the batches fit draws (batch 64, seed 0),
    forward and loss under `autocast` when given."""
    alone = _small_mlp()
    optimizer = _sgd(alone.parameters())
    samples = len(train[0])
    for epoch in range(1, epochs + 1):
        order = epoch_order(samples, 0, epoch)
        for index in range(samples // 64):
            picked = order[index * 64 : (index + 1) * 64]
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
                loss = nn.functional.cross_entropy(alone(train[0][picked]), train[1][picked])
            loss.backward()
            optimizer.step()
    return alone


def test_weights_land_in_the_callers_model_and_fit_continues() -> None:
    train = _digits(512)
    alone = _alone(train, epochs=2)

    model = _small_mlp()
    trainer = ms.Trainer(model, ms.Plan(dp=2), optimizer=_sgd, loss_fn=nn.CrossEntropyLoss())
    first = trainer.fit(TensorDataset(*train), epochs=1, batch_size=64, verbose=0)
    second = trainer.fit(train, epochs=1, batch_size=64, verbose=0)  # momentum carries over
    assert trainer.model is model
    assert [row["epoch"] for row in first + second] == [1.0, 2.0]
    for (key, got), want in zip(
        model.state_dict().items(), alone.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=key)
    scores = trainer.evaluate(ms.data.digits("test"))
    as_numpy = trainer.evaluate(
        tuple(t.numpy().astype(np.float64 if t.is_floating_point() else np.int32)
              for t in ms.data.digits("test"))
    )  # fmt: skip
    assert set(scores) == {"loss", "accuracy"}
    assert scores == pytest.approx(as_numpy)


def test_the_trainer_trains_in_mixed_precision_with_fp32_weights_in_the_callers_model() -> None:
    train = _digits(512)
    alone = _alone(train, epochs=1, autocast=torch.bfloat16)
    model = _small_mlp()
    plan = ms.Plan(dp=2, pp=2, precision="bf16-mixed")
    trainer = ms.Trainer(model, plan, optimizer=_sgd, loss_fn=nn.CrossEntropyLoss())
    trainer.fit(train, epochs=1, batch_size=64, verbose=0)
    for (key, got), want in zip(
        model.state_dict().items(), alone.state_dict().values(), strict=True
    ):
        assert got.dtype == torch.float32, key
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), key
    assert trainer.predict(train[0][:4]).dtype == torch.bfloat16  # as it trained


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(trainer_module, "launch", refuse)


def test_bad_input_is_refused_before_any_worker(no_launch) -> None:
    trainer = ms.Trainer(_small_mlp(), ms.Plan(dp=2), optimizer=_sgd)
    images, labels = ms.data.digits("train", image_size=8)
    with pytest.raises(ms.InputError, match=r"'fc1'.*784 input features.*\(2, 64\)"):
        trainer.fit((images, labels), epochs=1, batch_size=64)
    images, labels = ms.data.digits("train")
    with pytest.raises(ms.InputError, match=r"class labels 5\.\.14 .* 10 classes"):
        trainer.fit((images, labels + 5), epochs=1, batch_size=64)
    with pytest.raises(ms.InputError, match="1438 inputs but 100 targets"):
        trainer.fit((images, labels[:100]), epochs=1, batch_size=64)
    with pytest.raises(ms.PlanError, match="not divisible by dp"):
        trainer.fit((images, labels), epochs=1, batch_size=63)
    with pytest.raises(TypeError, match="DataLoader"):
        trainer.fit(torch.utils.data.DataLoader(TensorDataset(images, labels)), epochs=1)
    with pytest.raises(TypeError, match=r"\(inputs, targets\)"):
        trainer.fit(images, epochs=1)


def _fails_on_rank_1(params):
    if dist.get_rank() == 1:
        raise OSError("no space left for the optimizer")
    return _sgd(params)


def test_a_worker_error_reaches_the_caller() -> None:
    trainer = ms.Trainer(_small_mlp(), ms.Plan(dp=2), optimizer=_fails_on_rank_1)
    with pytest.raises(ms.WorkerError, match="no space left") as caught:
        trainer.fit(ms.data.digits("test"), epochs=1, batch_size=64, verbose=0)
    assert caught.value.rank == 1 and caught.value.error_type == "OSError"


def test_parameter_server_plan_from_the_trainer_equals_one_process() -> None:
    train = _digits(256)
    alone = _alone(train, epochs=1)

    model = _small_mlp()
    plan = ms.Plan(dp=2, sync="ps", servers=2)  # 2 workers + 2 servers
    trainer = ms.Trainer(model, plan, optimizer=_sgd, loss_fn=nn.CrossEntropyLoss())
    history = trainer.fit(train, epochs=1, batch_size=64, verbose=0)
    assert [row["epoch"] for row in history] == [1.0]
    for (key, got), want in zip(
        model.state_dict().items(), alone.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=key)
