"""The Plan's flags come from the Plan's fields, and the reference catalogue's parts fit."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

import meshsplit as ms
from meshsplit.cli.flags import NOT_FLAGS, add_plan_flags, field_docstrings, plan_from


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_plan_flags(parser)
    return parser


def test_every_plan_field_but_the_exceptions_is_a_flag_with_its_docstring() -> None:
    parser = _parser()
    flags = {action.dest: action for action in parser._actions}
    docstrings = field_docstrings()
    for field in dataclasses.fields(ms.Plan):
        if field.name in NOT_FLAGS:
            assert field.name not in flags
            continue
        assert flags[field.name].option_strings[0] == "--" + field.name.replace("_", "-")
        assert (
            flags[field.name].help and docstrings[field.name].split()[0] in flags[field.name].help
        )
    assert plan_from(parser.parse_args([])) == ms.Plan()


def test_flags_spell_the_plan() -> None:
    flags = "--dp 2 --pp 2 --micro-batches 4 --recompute except_last --memory-budget 2GiB"
    more = "--stages 3 2 --reserve-memory --bucket-mb 4 --nonfinite skip"
    args = _parser().parse_args([*flags.split(" "), *more.split(" ")])
    plan = plan_from(args)
    assert plan == ms.Plan(
        dp=2,
        pp=2,
        micro_batches=4,
        recompute="except_last",
        memory_budget="2GiB",
        stages=(3, 2),
        reserve_memory=True,
        bucket_mb=4.0,
        nonfinite="skip",
    )


@pytest.mark.parametrize("name", ms.models.REFERENCE_NAMES)
def test_reference_model_takes_its_data_and_loss(name: str) -> None:
    reference = ms.models.reference(name)
    inputs, targets = reference.example_batch(4)
    loss = reference.loss()(reference.model()(inputs), targets)
    assert loss.ndim == 0 and torch.isfinite(loss)
    for rows in (5, 2000):
        assert len(reference.samples(rows)[0]) == rows
    synthetic = reference.synthetic(3)
    assert (
        synthetic[0].shape[1:] == inputs.shape[1:] and synthetic[1].shape[1:] == targets.shape[1:]
    )


def test_unknown_reference_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="mlp, cnn, transformer"):
        ms.models.reference("resnet")
