"""The front end: any nn.Module to ordered layers whose data flow reproduces the model."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import meshsplit as ms
from meshsplit import phases
from meshsplit.pipeline import split_point
from meshsplit.pipeline.blocks import find_blocks
from meshsplit.pipeline.cuts import refuse_stages_without_parameters
from meshsplit.pipeline.frontend import LayerGraph, layer_graph
from meshsplit.pipeline.p2p import TensorMeta, decode, encode
from meshsplit.pipeline.profile import profile_layers
from meshsplit.pipeline.program import LayerProgram, plan_routes

from reference import build, train_plainly


def _run(graph: LayerGraph, x: torch.Tensor) -> torch.Tensor:
    values = {graph.input: x}
    for layer in graph.layers:
        values.update(zip(layer.outputs, layer(*(values[n] for n in layer.inputs)), strict=True))
    return values[graph.output]


def _state_names(graph: LayerGraph) -> set[str]:
    return {layer.prefix + key for layer in graph.layers for key in layer.module.state_dict()}


class Gate(nn.Module):
    """Data-dependent control flow: fx cannot trace through it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale if x.sum() > 0 else -x


class Encoder(nn.Module):
    """A model around an untraceable child: the front end keeps that child opaque."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.gate = nn.Sequential(nn.Linear(16, 16), Gate())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.embed(x)))


class Marked(nn.Module):
    """Split points by hand: three pieces, whatever the module structure."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = split_point(torch.relu(self.a(x)))
        x = torch.relu(self.b(x)) + x
        return self.c(split_point(x))


class RankDependent(nn.Module):
    """fx cannot branch on x.dim(); torch.export can (the rank is static)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(784, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 2:
            x = x.flatten(1)
        return self.b(torch.relu(self.a(x)))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum() > 0 else -self.a(x)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "skip_mlp"])
def test_layers_reproduce_the_model_and_keep_its_names(name: str) -> None:
    model = build(name)
    x = (
        torch.randint(0, 64, (3, 8))
        if name == "transformer"
        else ms.data.synthetic_images(3, seed=2)[0]
    )
    graph = layer_graph(model, x)
    torch.testing.assert_close(_run(graph, x), model(x))
    assert _state_names(graph) == set(model.state_dict())


def test_sequential_children_are_the_layers() -> None:
    graph = layer_graph(ms.models.mlp((784, 16, 10)))
    assert [layer.name for layer in graph.layers] == ["flatten", "fc1", "relu1", "fc2"]
    assert graph.source == "sequential"


def test_skip_connection_is_sent_straight_to_the_stage_that_reads_it() -> None:
    graph = layer_graph(build("skip_mlp"))
    assert [layer.name for layer in graph.layers] == ["flatten", "inp", "b1", "b2", "b3", "head"]
    assert graph.layers[4].inputs == ("b2_1", "inp")  # b3's layer reads inp: the skip
    routes = plan_routes(graph, (2, 1, 1, 2))
    assert routes[0].sends == ((1, ("inp",)), (3, ("inp",)))
    assert routes[3].receives == ((0, ("inp",)), (2, ("b2_1",)))
    assert routes[1].receives == ((0, ("inp",)),) and routes[1].sends == ((2, ("b1_1",)),)


def test_untraceable_submodule_becomes_one_opaque_layer() -> None:
    model = Encoder().eval()
    x = torch.randn(2, 5, 8)
    graph = layer_graph(model, x)
    # gate is an nn.Sequential of two blocks: each is a layer, the untraceable one opaque
    assert [layer.name for layer in graph.layers] == ["embed", "gate.0", "gate.1", "head"]
    assert "opaque: gate.1" in graph.source
    torch.testing.assert_close(_run(graph, x), model(x))
    assert _state_names(graph) == set(model.state_dict())


def test_split_points_mark_the_layers_by_hand() -> None:
    model = Marked()
    x = torch.randn(4, 8)
    graph = layer_graph(model, x)
    assert [layer.name for layer in graph.layers] == ["part0", "part1", "part2"]
    torch.testing.assert_close(_run(graph, x), model(x))


def test_export_takes_over_where_fx_fails_in_the_root_forward() -> None:
    model = RankDependent()
    x = ms.data.synthetic_images(4, seed=3)[0]
    graph = layer_graph(model, x)
    assert graph.source == "export"
    assert [layer.name for layer in graph.layers] == ["a", "b"]
    torch.testing.assert_close(_run(graph, x), model(x))
    assert _state_names(graph) == set(model.state_dict())


def test_untraceable_model_is_a_plan_error_naming_the_construct_and_the_fix() -> None:
    with pytest.raises(ms.PlanError) as caught:
        layer_graph(DataDependent(), torch.randn(2, 8))
    message = str(caught.value)
    assert "control flow" in message  # what stopped fx
    assert "nn.Sequential whose children are the pieces" in message  # how to split by hand
    with pytest.raises(ms.PlanError, match="example_inputs="):
        layer_graph(DataDependent())


def test_profile_measures_every_layer_and_leaves_the_model_unchanged() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 8)
    rng = torch.random.get_rng_state()
    costs = profile_layers(layer_graph(model), x)
    assert len(costs) == 4
    assert all(c.forward_ms > 0 and c.backward_ms >= 0 for c in costs)
    assert costs[0].parameter_bytes == (64 + 8) * 4 and costs[2].parameter_bytes == 0
    assert costs[0].activation_bytes == 4 * 8 * 4
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])
    assert torch.equal(torch.random.get_rng_state(), rng)


class _WaitsForPeers(nn.Module):
    """A Linear whose forward and backward each wait 50 ms for other ranks, as an operator
    split's collectives do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with phases.waiting("tp all-reduce wait"):
            time.sleep(0.05)
        return _WaitInBackward.apply(self.fc(x))


class _WaitInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        with phases.waiting("tp all-reduce wait"):
            time.sleep(0.05)
        return grad


def test_profile_leaves_out_the_waits_for_other_ranks() -> None:
    # the engine profiles a tp-split model whose collectives wait for peers, an estimate
    # profiles it with no peers: both must see the same compute, or they cut differently
    costs = profile_layers(
        layer_graph(nn.Sequential(_WaitsForPeers(), nn.ReLU())), torch.ones(4, 8)
    )
    assert costs[0].forward_ms < 25 and costs[0].backward_ms < 25, costs[0]


class _WaitingBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_WaitsForPeers(), _WaitsForPeers()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_the_block_front_end_leaves_out_the_waits_for_other_ranks_too() -> None:
    with torch.no_grad():
        pieces = find_blocks(_WaitingBlocks(), torch.ones(4, 8)).pieces
    assert [p.name for p in pieces] == ["blocks.0", "blocks.1"]
    assert all(p.forward_ms < 25 for p in pieces), [p.forward_ms for p in pieces]


def test_stages_that_cannot_train_are_refused_before_any_step() -> None:
    mlp = layer_graph(ms.models.mlp((784, 16, 10)))  # flatten fc1 relu1 fc2
    names = [layer.name for layer in mlp.layers]
    trainable = [any(True for _ in layer.module.parameters()) for layer in mlp.layers]
    with pytest.raises(ms.PlanError, match=r"stage 0 of Plan.stages=\[1, 3\] holds only layers"):
        refuse_stages_without_parameters(names, trainable, [1, 3])
    refuse_stages_without_parameters(names, trainable, [2, 2])


def test_a_header_carries_complex_tensors_and_names_a_dtype_it_cannot() -> None:
    metas = [TensorMeta((2, 4), torch.complex64, False), TensorMeta((3,), torch.float32, True)]
    assert decode(encode(metas)) == metas  # Llama 4's rotary frequencies cross stages
    with pytest.raises(TypeError, match=r"float8_e4m3fn crosses a pipeline stage boundary"):
        encode([TensorMeta((2,), torch.float8_e4m3fn, False)])


class Patches(nn.Module):
    """Returns the patches and the grid's height, as PVT's patch embeddings do: by a floor
    division of a shape, or by a shift (an operation on numbers the tracer's copies do not
    recompute, standing for any value that is no tensor)."""

    def __init__(self, shift: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 16)
        self.shift = shift

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.proj(x), (x.shape[1] >> 1) if self.shift else x.shape[1] // 2


class GridModel(nn.Module):
    """A height (an int) made by the first child and read two children later."""

    def __init__(self, shift: bool = True) -> None:
        super().__init__()
        self.patches = Patches(shift)
        self.mix = nn.Linear(16, 16)
        self.fold = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, height = self.patches(x)
        h = torch.tanh(self.mix(h))
        h = self.fold(h).reshape(h.shape[0], height, -1)
        return self.head(h.mean(1).reshape(h.shape[0], -1, 16).mean(1))


def _grid_losses(plan: ms.Plan | None, shift: bool = True) -> list[float]:
    torch.manual_seed(0)
    model = GridModel(shift)
    x, y = torch.randn(8, 6, 4), torch.randint(0, 3, (8,))
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    if plan is None:
        steps = [(x, y)] * 3
        return train_plainly(model, sgd(model.parameters()), nn.functional.cross_entropy, steps)[0]
    engine = ms.parallelize(model, plan, optimizer=sgd, loss_fn=nn.CrossEntropyLoss())
    return [engine.train_step(x, y) for _ in range(3)]


def test_a_value_that_is_no_tensor_keeps_its_maker_and_readers_in_one_layer() -> None:
    """PVT's patch embeddings hand their grid's height (an int) to the reshape after the
    block: the layers from the one making it to the last reading it become one, and the
    model still splits where tensors alone cross (it was refused whole)."""
    from meshsplit.pipeline.cuts import find_cuts

    x = torch.randn(4, 6, 4)
    cuts = find_cuts(GridModel(), x, ms.Plan(pp=2, micro_batches=1), lambda costs: costs)
    assert cuts.names == ("patches", "head") and sum(cuts.sizes) == 2
    per_rank = ms.launch(_grid_losses, 2, args=(ms.Plan(pp=2, micro_batches=2),))
    for losses in per_rank:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(_grid_losses(None)))


def test_a_number_made_from_a_shape_is_recomputed_where_it_is_read() -> None:
    """Arithmetic over shapes (the height as a floor division; torch.export's batch x heads
    inside nn.MultiheadAttention) is made again by each reader instead of crossing a cut, so
    the model splits between every child."""
    from meshsplit.pipeline.cuts import find_cuts

    x = torch.randn(4, 6, 4)
    model = GridModel(shift=False)
    cuts = find_cuts(model, x, ms.Plan(pp=2, micro_batches=1), lambda costs: costs)
    assert cuts.names == ("patches", "mix", "fold", "head")
    per_rank = ms.launch(_grid_losses, 2, args=(ms.Plan(pp=2, micro_batches=2), False))
    for losses in per_rank:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(_grid_losses(None, False)))


class Shift(nn.Module):
    """Adds one: autograd saves nothing of its input for an addition."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class SeesEarlier(nn.Module):
    """Records, as it runs, whether the first Linear's output (watched) is still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: Callable[[], torch.Tensor | None] = lambda: None
        self.alive_when_run: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.alive_when_run.append(self.watched() is not None)
        return x * 3


def test_a_stage_drops_each_value_after_its_last_reader() -> None:
    """A value no later layer reads and autograd does not save is freed while the stage's
    forward goes on, as in nn.Sequential; the values the stage sends stay."""
    seen = SeesEarlier()
    model = nn.Sequential(nn.Linear(4, 4), Shift(), nn.Linear(4, 4), seen, nn.Linear(4, 2))

    def watch(_: nn.Module, __: Any, output: torch.Tensor) -> None:
        seen.watched = weakref.ref(output)

    model[0].register_forward_hook(watch)
    x = torch.randn(3, 4)
    graph = layer_graph(model, x)
    routes = plan_routes(graph, [4, 1])
    program = LayerProgram(graph.layers[:4], graph, routes[0], last=False)
    assert program.dead == [
        [graph.input],
        [graph.layers[0].outputs[0]],
        [graph.layers[1].outputs[0]],
        [graph.layers[2].outputs[0]],
    ]
    (sent,) = program(x)
    assert seen.alive_when_run == [False]  # the Linear's output, read only by Shift, is gone
    torch.testing.assert_close(model[4](sent), model(x))


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this layer's backward needs what ran before it")


class FailsInBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailsInBackward.apply(x)


def test_a_layer_that_cannot_differentiate_alone_is_refused_before_any_step() -> None:
    model = nn.Sequential(nn.Linear(4, 4), FailsInBackward(), nn.Linear(4, 2))
    graph = layer_graph(model, torch.randn(3, 4))
    with pytest.raises(ms.PlanError, match=r"layer '1' .* cannot run and differentiate .*needs"):
        profile_layers(graph, torch.randn(3, 4), repeats=1)
