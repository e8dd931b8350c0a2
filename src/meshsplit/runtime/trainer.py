"""Trainer: fit and evaluate one model from a plain script; the workers start and end inside.

`fit` checks the plan, the batch and the dataset before any worker starts, then forks
`plan.world_size` workers (nothing pickled, the script not re-run, so no main guard is needed)
that split and train the model; rank 0's progress and history come back and its state dict is
loaded into `trainer.model`. A checkpoint between calls makes fit(epochs=1) twice train exactly
as fit(epochs=2) once. Rationale: docs/internals.md#runtimetrainerpy
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshsplit.batch import LossFn, call_model, rows, scores, take_rows
from meshsplit.job.context import in_torchrun
from meshsplit.job.input_errors import InputError, explain_input_error
from meshsplit.job.launch import DEFAULT_TIMEOUT_S, WorkerError, launch
from meshsplit.plan import Plan, PlanError
from meshsplit.precision import Precision
from meshsplit.runtime import training, user_data
from meshsplit.runtime.parallelize import default_optimizer, parallelize

__all__ = ["History", "Trainer"]

Optimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | torch.optim.Optimizer
_RERAISED = {"PlanError": PlanError, "InputError": InputError}
"""Errors in what the user asked for that a worker found: raised here as themselves."""


class History(list[dict[str, float]]):
    """One row per epoch: epoch, loss, samples_per_second (and val_loss, val_accuracy with
    validation_data). `.history` is the same by metric, as Keras gives it."""

    @property
    def history(self) -> dict[str, list[float]]:
        return {key: [row[key] for row in self] for key in (self[0] if self else {})}


@dataclass
class _Job:
    inputs: Any
    targets: Any
    epochs: int
    batch_size: int
    shuffle: bool
    validation: tuple[Any, Any] | None
    show: bool
    seed: int
    torchrun: bool
    """Whether this process is the worker (under torchrun); else the workers are forks of it
    (in which RANK and WORLD_SIZE are set too)."""


class Trainer:
    """Trains `model` under `plan` from the calling process; `trainer.model` is `model`.

    `optimizer`: a function of the parameters that builds one (a lambda is fine), or an
    optimizer built on `model.parameters()`, rebuilt in each worker with its hyperparameters.
    Default Adam(lr=1e-3). `loss_fn` defaults to nn.CrossEntropyLoss().
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        *,
        optimizer: Optimizer | None = None,
        loss_fn: LossFn | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be an ms.Plan; got {type(plan).__name__}")
        self.model = model
        self.plan = plan
        self.loss_fn: LossFn = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
        self.make_optimizer = _factory(optimizer)
        self.timeout_s = timeout_s
        self.epochs_done = 0
        """Epochs trained so far: the next fit continues the data order from here."""
        self._saved = False
        """Whether the workers left a checkpoint for the next fit to continue from."""
        self._folder: Path | None = None
        self._state_here: dict[str, torch.Tensor] | None = None

    def fit(
        self,
        dataset: Any,
        *,
        epochs: int = 1,
        batch_size: int = 32,
        shuffle: bool = True,
        validation_data: Any = None,
        verbose: int = 1,
        seed: int = 0,
    ) -> History:
        """Train `epochs` more epochs of global batches of `batch_size` over the plan's workers.

        `dataset`: (inputs, targets) as tensors or NumPy arrays (inputs may be a dict or tuple
        of them), or a map-style torch Dataset of (input, target) pairs. The last partial
        batch of each epoch is dropped. Raises PlanError or InputError before any worker
        starts when the plan, the batch or the data cannot work, and WorkerError when a worker
        fails.
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs={epochs!r} must be a positive integer")
        torchrun = in_torchrun()
        if torchrun:
            self.plan.check_world(int(os.environ["WORLD_SIZE"]))
        self.plan.check_batch(batch_size)
        inputs, targets = self._checked(dataset, "dataset")
        if batch_size > rows(inputs):
            raise InputError(
                f"batch_size={batch_size} exceeds the dataset's {rows(inputs)} samples; use "
                f"batch_size <= {rows(inputs)}"
            )
        validation = None
        if validation_data is not None:
            validation = self._checked(validation_data, "validation_data")
        job = _Job(
            inputs, targets, epochs, batch_size, shuffle, validation, verbose > 0, seed, torchrun
        )
        self._folder = self._folder or _private_folder(self)
        try:
            first = launch(
                self._train, self.plan.world_size, (job,), timeout_s=self.timeout_s,
                start_method="fork",  # no effect under torchrun: this process is the worker
            )[0]  # fmt: skip
        except WorkerError as error:
            raise _as_raised(error) from error
        state, self._state_here = first["state"] or self._state_here, None
        if state is not None:  # None: a rank with no model of its own (a parameter server)
            self.model.load_state_dict(state)
        self._saved = first["saved"]
        self.epochs_done += epochs
        return History(_keras_names(row) for row in first["history"])

    def _train(self, job: _Job) -> Any:
        """One worker's part: split, load the last fit's checkpoint, train, save, hand back."""
        model = copy.deepcopy(self.model) if job.torchrun else self.model  # forked: a copy
        engine = parallelize(model, self.plan, optimizer=self.make_optimizer, loss_fn=self.loss_fn)
        folder = self._shared_folder(job.torchrun)
        if folder is not None and self._saved:
            engine.load(folder)
        engine.data_position = {"epoch": self.epochs_done, "batch": 0}
        history = training.fit(
            engine,
            (job.inputs, job.targets),
            epochs=self.epochs_done + job.epochs,
            batch_size=job.batch_size,
            eval_data=job.validation,
            seed=job.seed,
            show=job.show,
            checkpoint_dir=None,
            shuffle=job.shuffle,
        )
        if folder is not None:
            engine.save(folder)
        state: dict[str, torch.Tensor] | None = engine.full_state_dict()
        engine.close()
        if job.torchrun:  # every rank loads its own copy; only rank 0's report is gathered
            self._state_here, state = state, None
        if dist.get_rank() != 0:
            return None
        return {"history": history, "state": state, "saved": folder is not None}

    def _shared_folder(self, torchrun: bool) -> Path | None:
        """Where the workers keep the training state between fits: a folder every rank of
        this job reads (rank 0's under torchrun on one machine), or None."""
        if getattr(self.plan, "sync", "allreduce") == "ps":
            return None
        if not torchrun:
            return self._folder
        if int(os.environ.get("LOCAL_WORLD_SIZE", -1)) != dist.get_world_size():
            return None
        names = [str(self._folder)]
        dist.broadcast_object_list(names, src=0)
        return Path(names[0])

    @torch.no_grad()
    def evaluate(self, dataset: Any, *, batch_size: int = 256) -> dict[str, float]:
        """Mean loss and accuracy of `trainer.model` on `dataset`, in this process (exact).

        Accuracy: the argmax of the last dimension against integer targets; under the
        plan's precision, as training ran."""
        inputs, targets = self._checked(dataset, "dataset")
        with _eval_mode(self.model), self._autocast():
            return scores(
                lambda x: call_model(self.model, x), self.loss_fn, inputs, targets, batch_size
            )

    @torch.no_grad()
    def predict(self, inputs: Any, *, batch_size: int = 256) -> Any:
        """`trainer.model`'s outputs for `inputs` (eval mode, no grad, the plan's precision),
        in this process."""
        inputs = user_data.as_tensors(inputs, user_data.float_dtype(self.model))
        with _eval_mode(self.model), self._autocast():
            outputs = [
                call_model(self.model, take_rows(inputs, slice(start, start + batch_size)))
                for start in range(0, rows(inputs), batch_size)
            ]
        return torch.cat(outputs) if isinstance(outputs[0], torch.Tensor) else outputs

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The plan's autocast on the device `trainer.model` is on (nothing under fp32)."""
        first = next(self.model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        return Precision(self.plan, device).autocast()

    def _checked(self, dataset: Any, name: str) -> tuple[Any, Any]:
        """`dataset` as (inputs, targets) tensors, refused with InputError when the model
        cannot take it: it runs on 2 rows (eval mode, no grad), then the loss."""
        inputs, targets = user_data.as_pair(dataset, name, user_data.float_dtype(self.model))
        if rows(inputs) != rows(targets):
            raise InputError(
                f"{name} has {rows(inputs)} inputs but {rows(targets)} targets; give one "
                "target per input row"
            )
        x, y = take_rows(inputs, slice(0, 2)), take_rows(targets, slice(0, 2))
        output = self._probe(name, x, lambda: call_model(self.model, x))
        user_data.check_classes(self.loss_fn, output, targets, name)  # all labels, not only 2 rows
        loss = self._probe(name, x, lambda: self.loss_fn(output, y))
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise InputError(f"loss_fn must return one number (a 0-dim tensor); got {loss!r}")
        return inputs, targets

    def _probe(self, name: str, x: Any, run: Callable[[], Any]) -> Any:
        """run() in eval mode without grad; an error names the layer (or loss) that failed."""
        try:
            with _eval_mode(self.model), torch.no_grad():
                return run()
        except Exception as error:
            where = f"Trainer checked 2 rows of the {name} before starting any worker"
            others = {"loss_fn": self.loss_fn}
            found = explain_input_error(error, self.model, x, where, others)
            raise (found or InputError(f"{where}: the model failed: {error}")) from error


def _factory(optimizer: Optimizer | None) -> Callable[[Iterable[nn.Parameter]], Any]:
    """A function of the parameters that builds the optimizer in a worker."""
    if optimizer is None:
        return default_optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        if len(optimizer.param_groups) != 1 or optimizer.state:
            raise ValueError(
                "optimizer= takes a fresh optimizer with one parameter group; for per-group "
                "settings pass a function, e.g. optimizer=lambda params: torch.optim.SGD(...)"
            )
        kind, settings = type(optimizer), dict(optimizer.defaults)
        return lambda params: kind(params, **settings)
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a function of the parameters; got {optimizer!r}")
    return optimizer


class _eval_mode:  # noqa: N801 - used as a context manager, like torch.no_grad
    """The model in eval mode inside, and in the mode it had after."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.was_training = model, model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        self.model.train(self.was_training)


def _private_folder(owner: Trainer) -> Path:
    """A temporary folder removed when `owner` is collected or the interpreter ends."""
    folder = Path(tempfile.mkdtemp(prefix="meshsplit-fit-"))
    weakref.finalize(owner, shutil.rmtree, folder, ignore_errors=True)
    return folder


def _as_raised(error: WorkerError) -> Exception:
    """A worker's PlanError or InputError as itself (naming the rank); others unchanged."""
    kind = _RERAISED.get(error.error_type)
    return kind(f"worker rank {error.rank}: {error.message}") if kind else error


def _keras_names(row: dict[str, float]) -> dict[str, float]:
    """Validation metrics under Keras's names: val_loss, val_accuracy."""
    return {key.replace("test_", "val_", 1): value for key, value in row.items()}
