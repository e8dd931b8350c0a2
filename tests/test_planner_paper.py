"""Paper mode: clusters load or are refused by field, and the analytic model behaves as derived.

Pure arithmetic, no processes: the shipped clusters, Eq. 3 on a case counted by hand, the
pipeline bubble, the link tensor parallelism pays, the memory check, and Megatron Table 1.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import meshsplit as ms
from meshsplit.planner.cluster import Cluster, cluster_names, load_cluster
from meshsplit.planner.megatron_table import megatron_table
from meshsplit.planner.paper import best_layout, predict
from meshsplit.planner.paper_model import GPTModel, Layout

A100 = load_cluster("dgx-a100")


@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100", "dgx-h200"])
def test_each_shipped_cluster_loads(name: str) -> None:
    cluster = load_cluster(name)
    assert isinstance(cluster, Cluster) and cluster.name == name
    assert cluster.devices_per_node == 8
    assert cluster.intra_node.bytes_per_s > cluster.inter_node.bytes_per_s
    assert cluster.peak_flops("bf16") >= 312e12
    assert name in cluster_names()


def test_h200_has_h100_compute_and_more_memory() -> None:
    h100, h200 = load_cluster("dgx-h100"), load_cluster("dgx-h200")
    assert h200.flops == h100.flops
    assert h200.memory_bytes == 141e9 > h100.memory_bytes


def _write(tmp_path: Path, change: dict, drop: str = "") -> Path:
    data = A100.as_dict()
    data.update(change)
    data.pop(drop, None)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    return path


def test_a_cluster_file_round_trips(tmp_path: Path) -> None:
    assert load_cluster(_write(tmp_path, {})) == A100
    assert load_cluster(str(_write(tmp_path, {}))) == A100


@pytest.mark.parametrize(
    ("change", "drop", "words"),
    [
        ({}, "memory_bytes", ["missing field 'memory_bytes'", "mine.json"]),
        ({"devices_per_node": -8}, "", ["'devices_per_node'=-8", "positive", "mine.json"]),
        ({"memory_bytes_per_s": 0}, "", ["'memory_bytes_per_s'=0", "positive"]),
        ({"memory_bytes": "80GB"}, "", ["'memory_bytes'='80GB'", "number"]),
        ({"inter_node": {"alpha_s": 1e-5}}, "", ["missing field 'inter_node.bytes_per_s'"]),
        ({"flops": {"bf16": -1}}, "", ["'flops.bf16'=-1", "positive"]),
        ({"link_efficiency": 1.5}, "", ["'link_efficiency'=1.5", "at most 1"]),
    ],
)
def test_a_bad_cluster_file_names_the_field(
    tmp_path: Path, change: dict, drop: str, words: list[str]
) -> None:
    with pytest.raises(ms.PlanError) as caught:
        load_cluster(_write(tmp_path, change, drop))
    for word in words:
        assert word in str(caught.value)


def test_an_unknown_cluster_name_lists_the_shipped_ones() -> None:
    with pytest.raises(ms.PlanError) as caught:
        load_cluster("dgx-z9000")
    assert "'dgx-z9000'" in str(caught.value)
    for name in ("dgx-a100", "dgx-h100", "dgx-h200"):
        assert name in str(caught.value)


def test_a_cluster_prices_ring_collectives_for_the_cost_model() -> None:
    machine = A100.machine(dtype="bf16")
    rate = 300e9 * A100.link_efficiency
    assert machine.flop_per_s == pytest.approx(312e12 * A100.matmul_efficiency)
    assert machine.cores is None
    nvlink = 14 * 5e-6 + 2 * 7 / 8 * 1e9 / rate
    assert machine.seconds("all_reduce", 8, 1e9) == pytest.approx(nvlink)
    assert machine.seconds("all_reduce", 16, 1e9) > 5 * nvlink  # crosses nodes: InfiniBand
    assert machine.seconds("all_gather", 8, 1e8) == pytest.approx(7 * (5e-6 + 1e8 / rate))


def test_an_unknown_dtype_lists_what_the_cluster_has() -> None:
    with pytest.raises(ms.PlanError, match="fp16"):
        A100.peak_flops("int4")


def test_flops_formula_matches_a_hand_count() -> None:
    # l=1, h=6, s=6, V=16, B=1: forward GEMMs 24*b*s*h^2 + 4*b*s^2*h = 5184 + 864 = 6048,
    # times 4 (forward, recompute, backward 2x) = 24192, plus logits 6*b*s*h*V = 3456.
    model = GPTModel(layers=1, hidden=6, heads=1, seq_len=6, vocab=16)
    assert model.flops(1) == pytest.approx(24192 + 3456)
    assert model.flops(3) == pytest.approx(3 * (24192 + 3456))
    # Eq. 2 for the 145.6B row of Table 1.
    assert megatron_table()[6].model().parameters / 1e9 == pytest.approx(145.6, abs=0.1)


MODEL = GPTModel(layers=48, hidden=8192, heads=64)


def test_bubble_shrinks_with_more_micro_batches_and_with_interleaving() -> None:
    def bubble(batch: int, interleave: int = 1) -> float:
        layout = Layout(tp=8, pp=4, dp=1, micro_batch=1, interleave=interleave)
        q = predict(MODEL, A100, layout, batch)
        return q.terms["bubble"] / (q.seconds - q.terms["bubble"])

    assert bubble(8) > bubble(32) > bubble(128)
    assert bubble(32, interleave=2) == pytest.approx(bubble(32) / 2, rel=0.05)
    ideal = predict(MODEL, A100, Layout(tp=8, pp=1, dp=4, micro_batch=1), 32)
    assert ideal.terms["bubble"] == 0


def test_tensor_split_beyond_a_node_pays_the_inter_node_link() -> None:
    fast_ib = dataclasses.replace(A100, inter_node=A100.intra_node)
    for tp, pays in ((8, False), (16, True)):
        layout = Layout(tp=tp, pp=1, dp=1, micro_batch=1)
        slow = predict(MODEL, A100, layout, 8).terms["tp_comm"]
        fast = predict(MODEL, fast_ib, layout, 8).terms["tp_comm"]
        assert (slow > 5 * fast) if pays else (slow == fast)


def test_a_layout_over_memory_is_infeasible_with_a_memory_reason() -> None:
    big = megatron_table()[-1].model()
    q = predict(big, A100, Layout(tp=8, pp=8, dp=1, micro_batch=1), 64)
    assert not q.feasible
    assert "GB per GPU" in q.reason and "Adam" in q.reason
    assert q.memory_bytes > A100.memory_bytes
    ranking = best_layout(big, A100, 3072, 3072)
    assert q.layout not in [r.layout for r in ranking.ranked]
    assert all(not r.feasible for r in ranking.infeasible)
    assert "GB per GPU" in ranking.why(ranking.infeasible[0])


def test_megatron_table_is_predicted_within_20_percent_for_most_rows() -> None:
    close = 0
    for row in megatron_table():
        ranking = best_layout(row.model(), A100, row.gpus, row.batch, mesh=(row.tp, row.pp, row.dp))
        close += abs(ranking.best.tflops_per_gpu / row.tflops - 1) <= 0.20
    assert close >= 7


def test_best_layout_is_the_published_one_or_predicted_faster_with_a_reason() -> None:
    for row in megatron_table():
        ranking = best_layout(row.model(), A100, row.gpus, row.batch)
        mine = ranking.best_for(row.tp, row.pp, row.dp)
        assert mine is not None, row.name
        best = ranking.best
        assert best.seconds <= mine.seconds
        assert best.tflops_per_gpu == pytest.approx(
            row.model().flops(row.batch) / best.seconds / row.gpus / 1e12
        )
        assert sum(best.terms.values()) == pytest.approx(best.seconds)
        if best.layout.mesh != (row.tp, row.pp, row.dp):
            reason = ranking.why(mine)
            assert "slower than" in reason and best.layout.describe() in reason


def test_interleave_can_be_capped() -> None:
    row = megatron_table()[-1]
    plain = best_layout(row.model(), A100, row.gpus, row.batch, max_interleave=1)
    assert {q.layout.interleave for q in plain.ranked} == {1}


def test_bad_layouts_are_plan_errors() -> None:
    with pytest.raises(ms.PlanError, match="does not divide heads"):
        predict(MODEL, A100, Layout(tp=3, pp=1, dp=1, micro_batch=1), 8)
    with pytest.raises(ms.PlanError, match="does not divide layers"):
        predict(MODEL, A100, Layout(tp=1, pp=5, dp=1, micro_batch=1), 8)
    with pytest.raises(ms.PlanError, match="does not split batch"):
        predict(MODEL, A100, Layout(tp=1, pp=1, dp=3, micro_batch=1), 8)
