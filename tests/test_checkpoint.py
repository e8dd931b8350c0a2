"""Checkpoints: resume equals uninterrupted training, across plans; bad checkpoints fail clearly."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import meshsplit as ms

from reference import ATOL, OPTIMIZERS, RTOL, batches, build, loss_for, train_single

MODEL, OPTIMIZER, BATCH = "small_mlp", "adamw", 16


def _engine(plan: ms.Plan) -> ms.Engine:
    return ms.parallelize(
        build(MODEL), plan, optimizer=OPTIMIZERS[OPTIMIZER], loss_fn=loss_for(MODEL)
    )


def _train(plan: ms.Plan, steps: range, load_from: str | None, save_to: str | None) -> dict:
    """Run the given global steps (of a fixed batch sequence), loading and saving around them."""
    engine = _engine(plan)
    if load_from:
        engine.load(load_from)
    data = batches(MODEL, BATCH, 6)
    losses = [engine.train_step(*data[step]) for step in steps]
    if save_to:
        engine.save(save_to)
    state, count = engine.full_state_dict(), engine.steps
    engine.close()
    return {"losses": losses, "state": state, "steps": count}


def _assert_state(state: dict, expected: dict) -> None:
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=key)


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[list[float], dict]:
    return train_single(MODEL, OPTIMIZER, batch=BATCH, steps=6)


@pytest.mark.parametrize(
    ("saved_under", "loaded_under"),
    [
        (ms.Plan(dp=2), ms.Plan()),
        (ms.Plan(dp=2, zero=True), ms.Plan()),
        (ms.Plan(tp=2), ms.Plan(dp=2)),
        (ms.Plan(dp=2), ms.Plan(tp=2)),
        (ms.Plan(dp=2, pp=2, micro_batches=2), ms.Plan(dp=2, tp=2)),
        # into ZeRO 2/3 (each rank takes its slice of every parameter and moment), and tp
        # shards that ZeRO shards again over dp (saved in dp x tp pieces)
        (ms.Plan(dp=2, zero=3), ms.Plan(dp=2, zero=3)),
        (ms.Plan(), ms.Plan(dp=2, zero=2)),
        (ms.Plan(dp=2, tp=2, zero=2), ms.Plan(dp=2, tp=2, zero=3)),
        (ms.Plan(dp=2, tp=2, zero=3), ms.Plan(tp=2)),
    ],
    ids=[
        "dp2-to-1",
        "zero-to-1",
        "tp2-to-dp2",
        "dp2-to-tp2",
        "dp2pp2-to-dp2tp2",
        "zero3-to-zero3",
        "1-to-zero2",
        "dp2tp2zero2-to-dp2tp2zero3",
        "dp2tp2zero3-to-tp2",
    ],
)
def test_resume_across_plans_equals_uninterrupted(
    tmp_path, uninterrupted, saved_under: ms.Plan, loaded_under: ms.Plan
) -> None:
    losses, expected = uninterrupted
    first = ms.launch(
        _train, saved_under.world_size, args=(saved_under, range(3), None, str(tmp_path))
    )
    assert first[0]["steps"] == 3
    # stop all processes; resume under another plan for the next three steps
    second = ms.launch(
        _train, loaded_under.world_size, args=(loaded_under, range(3, 6), str(tmp_path), None)
    )
    assert second[0]["steps"] == 6
    torch.testing.assert_close(
        torch.tensor(first[0]["losses"] + second[0]["losses"]),
        torch.tensor(losses),
        rtol=RTOL,
        atol=ATOL,
    )
    _assert_state(second[0]["state"], expected)
    # and into one process with no process group at all
    partial = ms.load_full_state_dict(tmp_path)
    _assert_state(partial, first[0]["state"])


def test_tp_shards_under_zero_3_are_saved_in_pieces_no_rank_gathers(tmp_path) -> None:
    """A tp shard that ZeRO 3 shards again over dp is saved as dp x tp pieces, each rank its
    own: gathering the tp shard over dp first would hold what ZeRO 3 is there to avoid."""
    ms.launch(_train, 4, args=(ms.Plan(dp=2, tp=2, zero=3), range(1), None, str(tmp_path)))
    folder = tmp_path / (tmp_path / "latest").read_text()
    saved = FileSystemReader(folder).read_metadata().state_dict_metadata
    pieces = {
        key: [math.prod(chunk.sizes) for chunk in item.chunks]
        for key, item in saved.items()
        if key.startswith(("model/", "optim/")) and len(item.size) > 0
    }
    # every weight is split over tp (fc1, fc3 by rows, fc2, fc4 by columns), and the biases of
    # the row-split layers with it; the others' biases are whole over tp, sharded over dp
    whole_over_tp = ("fc2.bias", "fc4.bias")
    for key, sizes in pieces.items():
        total = math.prod(saved[key].size)
        parts = 2 if key.split("/")[1] in whole_over_tp else 4
        assert sizes == [total // parts] * parts, key
    assert len(pieces) == 8 * 3  # 8 parameters, each with two AdamW moments


def _halving(optimizer: torch.optim.Optimizer) -> None:
    """A learning-rate schedule that moves from where it is (as torch's chainable ones do)."""
    for group in optimizer.param_groups:
        group["lr"] *= 0.5


def _train_halving(plan: ms.Plan, steps: range, load_from: str | None, save_to: str | None):
    engine = ms.parallelize(build(MODEL), plan, optimizer=_sgd, loss_fn=loss_for(MODEL))
    if load_from:
        engine.load(load_from)
    data = batches(MODEL, BATCH, 6)
    for step in steps:
        engine.train_step(*data[step])
        _halving(engine.optimizer)
    if save_to:
        engine.save(save_to)
    state, lrs = engine.full_state_dict(), [g["lr"] for g in engine.optimizer.param_groups]
    engine.close()
    return state, lrs


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize(
    ("saved_under", "loaded_under"),
    [
        (ms.Plan(dp=2), ms.Plan(dp=2, zero=1)),
        (ms.Plan(dp=2, zero=1), ms.Plan(pp=2, micro_batches=2)),
    ],
    ids=["dp2-to-zero1", "zero1-to-pp2"],
)
def test_a_learning_rate_schedule_resumes_where_it_was(
    tmp_path, saved_under: ms.Plan, loaded_under: ms.Plan
) -> None:
    model = build(MODEL)
    optimizer = _sgd(model.parameters())
    for x, y in batches(MODEL, BATCH, 6):
        optimizer.zero_grad()
        loss_for(MODEL)(model(x), y).backward()
        optimizer.step()
        _halving(optimizer)
    ms.launch(_train_halving, 2, args=(saved_under, range(3), None, str(tmp_path)))
    for state, lrs in ms.launch(
        _train_halving, 2, args=(loaded_under, range(3, 6), str(tmp_path), None)
    ):
        assert lrs == [0.1 * 0.5**6]  # not 0.1 * 0.5**3: the schedule did not start again
        _assert_state(state, model.state_dict())


def test_settings_of_another_number_of_groups_are_left_as_the_factory_made_them() -> None:
    from meshsplit.runtime import optimizer_settings

    weight, bias = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    saved = optimizer_settings.settings(torch.optim.SGD([weight, bias], lr=0.5))
    two_groups = torch.optim.SGD([{"params": [weight]}, {"params": [bias], "lr": 0.2}], lr=0.1)
    with pytest.warns(UserWarning, match="1 optimizer parameter groups and this optimizer has 2"):
        optimizer_settings.restore(two_groups, saved)
    assert [g["lr"] for g in two_groups.param_groups] == [0.1, 0.2]


def test_optimizer_state_missing_from_a_checkpoint_is_said_and_a_tied_alias_is_found() -> None:
    import warnings

    from meshsplit.runtime.optimizer_keys import match_saved

    tied, other = torch.ones(4), torch.ones(3)
    names = {"emb.weight": tied, "head.weight": tied, "norm.weight": other}
    wanted = ["optim/emb.weight/exp_avg", "optim/norm.weight/exp_avg"]
    # the tie's state under its other name is found, and nothing is missing
    state = dict.fromkeys(wanted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        renamed = match_saved(state, {"optim/head.weight/exp_avg": 1, wanted[1]: 1}, names)
    assert renamed == {"optim/head.weight/exp_avg": wanted[0]}
    assert set(state) == {"optim/head.weight/exp_avg", wanted[1]}
    # one of two missing: said, with its key
    with pytest.warns(UserWarning, match=r"no optimizer state for 1 of this rank's 2 .*norm"):
        match_saved(dict.fromkeys(wanted), {wanted[0]: 1}, names)
    # none saved (a checkpoint written before the first step): nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        match_saved(dict.fromkeys(wanted), {}, names)
    # none of ours, though the checkpoint holds another optimizer's state (SGD's momentum
    # read by Adam): said, naming what it holds
    sgd = {"optim/emb.weight/momentum_buffer": 1, "optim/qkv/momentum_buffer#part0of3dim0": 1}
    with pytest.warns(UserWarning, match=r"\(momentum_buffer\) but none of this rank's 2 "):
        match_saved(dict.fromkeys(wanted), sgd, names)  # a fused tensor's parts: one name


def test_interrupted_save_keeps_previous_checkpoint(tmp_path) -> None:
    ms.launch(_train, 1, args=(ms.Plan(), range(2), None, str(tmp_path)))
    good = ms.load_full_state_dict(tmp_path)
    # a save that died midway leaves only a .partial folder behind
    broken = tmp_path / "step-00000009.partial"
    broken.mkdir()
    (broken / "__0_0.distcp").write_bytes(b"half a file")
    _assert_state(ms.load_full_state_dict(tmp_path), good)


def test_missing_checkpoint_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ms.CheckpointError, match="no checkpoint in"):
        ms.load_full_state_dict(tmp_path / "nowhere")


def test_corrupt_checkpoint_is_a_clear_error(tmp_path) -> None:
    ms.launch(_train, 1, args=(ms.Plan(), range(1), None, str(tmp_path)))
    folder = tmp_path / (tmp_path / "latest").read_text()
    (folder / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(ms.CheckpointError, match="corrupt"):
        ms.load_full_state_dict(tmp_path)


def _load_other_model(directory: str) -> None:
    engine = ms.parallelize(ms.models.mlp((784, 8, 10)), ms.Plan())
    engine.load(directory)


def test_checkpoint_of_another_model_is_refused(tmp_path) -> None:
    ms.launch(_train, 1, args=(ms.Plan(), range(1), None, str(tmp_path)))
    with pytest.raises(ms.WorkerError) as caught:
        ms.launch(_load_other_model, 1, args=(str(tmp_path),))
    assert caught.value.error_type == "CheckpointError"
    assert "another model" in caught.value.message
