"""Every bad plan is refused with a PlanError that names the field and a fix."""

from __future__ import annotations

import dataclasses

import pytest

import meshsplit as ms


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"dp": 0}, ["Plan.dp=0", "positive"]),
        ({"pp": -1}, ["Plan.pp=-1"]),
        ({"tp": 1.5}, ["Plan.tp=1.5"]),
        ({"micro_batches": 0}, ["Plan.micro_batches=0"]),
        ({"schedule": "zigzag"}, ["Plan.schedule='zigzag'", "1f1b", "gpipe"]),
        ({"recompute": "sometimes"}, ["Plan.recompute='sometimes'", "except_last"]),
        ({"pp": 2, "stages": (3,)}, ["Plan.stages=[3]", "pp=2"]),
        ({"pp": 2, "virtual_stages": 2}, ["Plan.virtual_stages=2", "schedule='interleaved'"]),
        (
            {"pp": 2, "micro_batches": 3, "schedule": "interleaved"},
            ["micro_batches=3", "multiple of pp=2", "micro_batches=2"],
        ),
        (
            {
                "pp": 2,
                "micro_batches": 2,
                "schedule": "interleaved",
                "virtual_stages": 2,
                "stages": (1, 1),
            },
            ["Plan.stages=[1, 1]", "4 chunks"],
        ),
        (
            {"pp": 2, "schedule": "zbv", "virtual_stages": 4},
            ["Plan.schedule='zbv'", "two chunks per rank", "virtual_stages=4"],
        ),
    ],
)
def test_bad_fields_are_refused(fields: dict, words: list[str]) -> None:
    with pytest.raises(ms.PlanError) as caught:
        ms.Plan(**fields)
    for word in words:
        assert word in str(caught.value)


def test_plan_error_is_a_value_error() -> None:
    assert issubclass(ms.PlanError, ValueError)


def test_world_size_must_match_processes() -> None:
    with pytest.raises(ms.PlanError, match=r"dp\*pp\*tp = 2\*1\*1 = 2 does not match 4.*dp=4"):
        ms.Plan(dp=2).check_world(4)
    ms.Plan(dp=4).check_world(4)


def test_batch_must_split_into_replicas_and_micro_batches() -> None:
    with pytest.raises(ms.PlanError, match=r"global batch 30 .* dp\*micro_batches = 4\*2 = 8"):
        ms.Plan(dp=4, micro_batches=2).check_batch(30)
    ms.Plan(dp=4, micro_batches=2).check_batch(32)


def test_plan_is_frozen_and_keyword_only() -> None:
    plan = ms.Plan(dp=2)
    with pytest.raises(AttributeError):
        plan.dp = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        ms.Plan(2)  # type: ignore[misc]


def test_memory_options_take_their_listed_values_and_name_the_rest() -> None:
    assert ms.Plan(dp=2, zero=True).zero == 1 and ms.Plan(zero=False).zero == 0
    assert ms.Plan(dp=2, zero=3).describe() == "dp2 pp1 tp1 zero3"
    for field, value in (("zero", 4), ("zero", "2"), ("compress", "fp4"),
                         ("compress_transfers", "int8"), ("offload", "disk")):  # fmt: skip
        with pytest.raises(ms.PlanError, match=f"Plan.{field}={value!r}"):
            ms.Plan(**{field: value})
    assert ms.Plan(compress="int8").lossy and not ms.Plan(offload="optimizer").lossy


def test_the_old_checkpoint_keyword_warns_and_means_recompute() -> None:
    with pytest.warns(DeprecationWarning, match=r"Plan\(recompute=\.\.\.\)"):
        plan = ms.Plan(pp=2, checkpoint="except_last")
    assert plan.recompute == "except_last" and plan.as_dict()["recompute"] == "except_last"
    with pytest.raises(ms.PlanError, match="Plan.recompute='sometimes'"):
        ms.Plan(checkpoint="sometimes")


BAD_VALUES = [-1, 0, 1.5, "2", None, True, [], "nonsense", 10**9]
VALID_AMONG_THEM = {  # field -> repr of the values above that are a valid form of it
    "dp": ["1000000000"],
    "pp": ["1000000000"],
    "tp": ["1000000000"],
    "micro_batches": ["1000000000"],
    "stages": ["None"],
    "virtual_stages": [],  # none alone: a number other than 1 needs schedule='interleaved'
    "split_points": ["None", "[]"],  # no cut: the pp - 1 = 0 cuts of one stage
    "tp_plan": ["None"],
    "zero": ["0", "True"],  # True means 1
    "capacity_factor": ["1.5", "None", "1000000000"],
    "ep_plan": ["None"],
    "bucket_mb": ["1.5", "1000000000"],
    "memory_budget": ["'2'", "None", "1000000000"],  # bytes
    "reserve_memory": ["True"],
    "servers": ["None"],
    "staleness": ["0"],
}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ms.Plan)])
def test_every_field_refuses_what_it_cannot_take_with_a_plan_error(field: str) -> None:
    assert set(VALID_AMONG_THEM) <= {f.name for f in dataclasses.fields(ms.Plan)}
    for value in BAD_VALUES:
        if repr(value) in VALID_AMONG_THEM.get(field, []):
            ms.Plan(**{field: value})
            continue
        with pytest.raises(ms.PlanError, match=rf"{field}="):
            ms.Plan(**{field: value})
