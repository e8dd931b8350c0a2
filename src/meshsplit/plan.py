"""The Plan: how one model is split over dp x pp x tp processes, checked before work starts."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field

from meshsplit.plan_values import PlanError, check_layer_split, divisors, parse_bytes

__all__ = ["Plan", "PlanError", "divisors"]

RECOMPUTE_POLICIES = ("never", "except_last", "always", "auto")
ZERO_STAGES = (0, 1, 2, 3)
COMPRESSIONS = ("none", "bf16", "fp8", "int8")
TRANSFER_COMPRESSIONS = ("none", "bf16")
OFFLOADS = ("none", "optimizer", "activations")
NONFINITE = ("raise", "skip", "off")
SYNCS = ("allreduce", "ps")
WHOLE_MODEL_DEFAULTS = {"pp": 1, "tp": 1, "ep": 1, "zero": 0, "offload": "none"}
"""The fields sync='ps' keeps at their defaults: every worker holds the whole model."""
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
REDUCE_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Mesh shape and options; dp * pp * tp processes run one model."""

    dp: int = 1
    """Data-parallel replicas: each takes 1/dp of the global batch."""
    pp: int = 1
    """Pipeline stages (layer split): consecutive layers on different processes."""
    tp: int = 1
    """Operator-split width: each split operator's weight is divided over tp processes."""
    micro_batches: int = 1
    """Micro-batches per step on each data-parallel replica (the pipeline's unit of work)."""
    schedule: str = "1f1b"
    """Pipeline schedule: '1f1b' (bounded activations), 'gpipe' (all forwards, then backwards),
    'interleaved' (virtual_stages chunks per rank, a smaller bubble), 'zero-bubble' (ZB-H1:
    weight gradients deferred into the bubble) or 'zbv' (ZB-V: two chunks per rank in a V,
    weight gradients deferred, about half ZB-H1's bubble at 1F1B's activations)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank under schedule='interleaved' (rank r holds chunks r,
    r+pp, ...); 2 under 'zbv' (rank r holds chunks r and 2*pp-1-r; set by it); 1 otherwise."""
    stages: tuple[int, ...] | None = None
    """Layers per pipeline stage (chunk, under 'interleaved'), overriding the profile-balanced
    split (len == pp * virtual_stages)."""
    split_points: tuple[str, ...] | None = None
    """Module paths where a pipeline stage begins, e.g. ('m.model.layers.2',) for pp=2; as
    torch.distributed.pipelining's split_spec, overriding the profile-balanced split."""
    recompute: str = "never"
    """Activation recomputation: 'never', 'except_last' (every stage but the last), 'always'
    (every stage, or every block when pp == 1) or 'auto' (the blocks that make the plan fit
    memory_budget with the least added time; nothing without a budget)."""
    tp_plan: Mapping[str, str] | None = field(default=None, hash=False)
    """Per-module operator split overriding the automatic rule, e.g. {'fc1': 'column'}."""
    ep: int = 1
    """Expert-parallel width: each mixture-of-experts layer's experts divided over ep of the
    dp ranks (ep divides dp), tokens sent to their experts by all-to-all."""
    capacity_factor: float | None = None
    """ep > 1: at most capacity_factor x (tokens x top-k / experts) tokens per expert from
    each rank, the rest dropped and counted; None: dropless (exact)."""
    ep_plan: Mapping[str, str] | None = field(default=None, hash=False)
    """Experts modules named by hand, e.g. {'model.layers.0.mlp.experts': 'experts'}."""
    zero: int = 0
    """Shard training state over dp (ZeRO): 0 none, 1 optimizer state, 2 also gradients
    (reduce-scatter instead of all-reduce), 3 also parameters (gathered per block for
    forward and backward, freed after). True means 1."""
    compress: str = "none"
    """Pack the tensors saved for backward: 'bf16' (about 2x smaller), 'fp8' or 'int8'
    (about 4x, per-channel scales). Lossy: outside the exactness contract."""
    compress_transfers: str = "none"
    """'bf16': send pipeline activations and their gradients as bfloat16 (half the p2p
    bytes). Lossy: outside the exactness contract."""
    offload: str = "none"
    """'optimizer': optimizer state (and its step) on the host, or in a memory-mapped file
    when the model already runs on the host; 'activations': tensors saved for backward on
    the host (GPU only)."""
    precision: str = "fp32"
    """'fp32', 'bf16-mixed' or 'fp16-mixed': forward and loss under torch.autocast in that dtype
    (pipeline transfers too), parameters, gradients and optimizer state kept in fp32;
    fp16 adds a dynamic loss scale (GradScaler's rule) whose overflowing steps are skipped."""
    reduce_dtype: str = "fp32"
    """The dtype gradients are summed in over dp: 'fp32', or 'bf16' (half the bytes, lossy)."""
    bucket_mb: float = 8.0
    """Size of the gradient all-reduce buckets over dp, in MiB (smaller: more overlap)."""
    memory_budget: str | int | None = None
    """Live tensor bytes each rank may hold, e.g. '2GiB', '512MB' or an int of bytes: checked
    against the estimate before the first step and enforced while training."""
    reserve_memory: bool = False
    """GPU: make the caching allocator hold the rank's estimated peak before step 1."""
    nonfinite: str = "raise"
    """A NaN or infinite loss or gradient: 'raise' stops every rank with NonFiniteError
    naming the step, ranks and first parameter; 'skip' drops that update on every rank
    alike; 'off' does not check (one pass over the gradients a step less)."""
    sync: str = "allreduce"
    """How the dp replicas meet: 'allreduce' (gradients summed among them every step) or
    'ps' (parameter servers: `servers` more processes own the parameters and run the
    optimizer; workers push gradients and pull parameters)."""
    servers: int | None = None
    """Parameter-server processes beside the dp workers (sync='ps'; default 1)."""
    staleness: int = 0
    """sync='ps': 0 is synchronous (exactly one process's result); K > 0 lets the servers
    update without the slowest worker, as long as no worker's parameters fall more than K
    updates behind the newest."""

    checkpoint: InitVar[str | None] = None
    """The former name of `recompute` (it collided with checkpoints on disk); warns, and goes
    in the next release."""

    def __post_init__(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            warnings.warn(
                "Plan(checkpoint=...) is now Plan(recompute=...); the old keyword goes in the "
                "next release",
                DeprecationWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "recompute", checkpoint)
        for name in ("dp", "pp", "tp", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(
                    f"Plan.{name}={value!r} must be a positive integer; use {name}=1 or more"
                )
        if self.recompute not in RECOMPUTE_POLICIES:
            raise PlanError(
                f"Plan.recompute={self.recompute!r} is unknown; "
                f"use one of {', '.join(RECOMPUTE_POLICIES)}"
            )
        if self.schedule == "zbv" and self.virtual_stages == 1:
            object.__setattr__(self, "virtual_stages", 2)  # the V: two chunks per rank
        stages, points = check_layer_split(
            self.pp, self.micro_batches, self.schedule, self.virtual_stages, self.stages,
            self.split_points,
        )  # fmt: skip
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "split_points", points)
        tp_plan = self.tp_plan
        if tp_plan is not None and not (
            isinstance(tp_plan, Mapping)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in tp_plan.items())
        ):
            raise PlanError(
                f"Plan.tp_plan={tp_plan!r} must map module paths to split styles (str to str); "
                "e.g. tp_plan={'fc1': 'column', 'fc2': 'row'} or leave it None"
            )
        if not isinstance(self.reserve_memory, bool):
            raise PlanError(f"Plan.reserve_memory={self.reserve_memory!r} must be True or False")
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget, "Plan.memory_budget")
        self._check_memory_options()
        self._check_experts()
        self._check_sync()
        bucket = self.bucket_mb
        if not isinstance(bucket, int | float) or isinstance(bucket, bool) or not bucket > 0:
            raise PlanError(f"Plan.bucket_mb={bucket!r} must be a positive number of MiB; e.g. 25")

    def _check_memory_options(self) -> None:
        """zero as a stage number (True is 1); the other options from their lists."""
        zero = self.zero
        if isinstance(zero, bool):
            object.__setattr__(self, "zero", int(zero))
        elif not isinstance(zero, int) or zero not in ZERO_STAGES:
            raise PlanError(
                f"Plan.zero={zero!r} is not a ZeRO stage; use 0 (none), 1 (optimizer state), "
                "2 (+ gradients) or 3 (+ parameters); True means 1"
            )
        for name, allowed in (
            ("compress", COMPRESSIONS),
            ("compress_transfers", TRANSFER_COMPRESSIONS),
            ("offload", OFFLOADS),
            ("nonfinite", NONFINITE),
            ("precision", PRECISIONS),
            ("reduce_dtype", REDUCE_DTYPES),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise PlanError(
                    f"Plan.{name}={value!r} is unknown; use one of "
                    f"{', '.join(repr(a) for a in allowed)}"
                )

    def _check_experts(self) -> None:
        """ep carved out of dp; a cap that is a positive number; experts named by path."""
        if not _positive(self.ep) or self.dp % self.ep:
            raise PlanError(
                f"Plan.ep={self.ep!r} must be a positive integer that divides dp={self.dp} (ep "
                f"ranks are dp ranks but for the experts); use ep in {divisors(self.dp)}"
            )
        cap = self.capacity_factor
        if cap is not None and (
            not isinstance(cap, int | float) or isinstance(cap, bool) or not cap > 0
        ):
            raise PlanError(
                f"Plan.capacity_factor={cap!r} must be a positive number (e.g. 1.25) or None "
                "(dropless: every token reaches its experts)"
            )
        names = self.ep_plan
        if names is not None and not (
            isinstance(names, Mapping)
            and all(isinstance(k, str) and v == "experts" for k, v in names.items())
        ):
            raise PlanError(
                f"Plan.ep_plan={names!r} must map module paths to 'experts'; e.g. "
                "ep_plan={'model.layers.0.mlp.experts': 'experts'} or leave it None"
            )

    def _check_sync(self) -> None:
        """Parameter servers run whole-model replicas with the optimizer on the servers."""
        if self.sync not in SYNCS:
            raise PlanError(
                f"Plan.sync={self.sync!r} is unknown; use one of {', '.join(map(repr, SYNCS))}"
            )
        if self.sync == "allreduce":
            if self.servers is not None or self.staleness != 0:
                raise PlanError(
                    f"Plan.servers={self.servers!r} / staleness={self.staleness!r} apply to "
                    "parameter servers only; add sync='ps' or leave them unset"
                )
            return
        servers = 1 if self.servers is None else self.servers
        if not isinstance(servers, int) or isinstance(servers, bool) or servers < 1:
            raise PlanError(
                f"Plan.servers={self.servers!r} must be a positive integer: sync='ps' needs "
                "at least one server process; e.g. servers=1"
            )
        object.__setattr__(self, "servers", servers)
        staleness = self.staleness
        if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
            raise PlanError(
                f"Plan.staleness={staleness!r} must be 0 (synchronous) or a positive number "
                "of updates a worker may lag; e.g. staleness=2"
            )
        unsupported = [
            f"{name}={getattr(self, name)!r}"
            for name, default in WHOLE_MODEL_DEFAULTS.items()
            if getattr(self, name) != default
        ]
        if unsupported:
            raise PlanError(
                f"sync='ps' keeps a whole model on every worker and the optimizer on the "
                f"servers, so it does not combine with {', '.join(unsupported)}; use "
                "sync='allreduce' for layer or operator split and sharded state"
            )

    @property
    def server_count(self) -> int:
        """Parameter-server processes (0 without sync='ps')."""
        return self.servers or 0

    @property
    def asynchronous(self) -> bool:
        """Whether the workers run without waiting for each other (parameter servers with
        staleness > 0): no collective among them inside a step."""
        return self.sync == "ps" and self.staleness > 0

    @property
    def lossy(self) -> bool:
        """Whether a memory option changes the numbers (outside the exactness contract)."""
        changed = (self.compress, self.compress_transfers, self.reduce_dtype)
        return changed != ("none", "none", "fp32")

    @property
    def budget_bytes(self) -> int | None:
        """memory_budget in bytes (None: no budget)."""
        if self.memory_budget is None:
            return None
        return parse_bytes(self.memory_budget, "Plan.memory_budget")

    @property
    def chooses_recompute(self) -> bool:
        """Whether recompute is picked to fit a budget ('auto' with memory_budget set)."""
        return self.recompute == "auto" and self.memory_budget is not None

    @property
    def mesh_size(self) -> int:
        """Processes on the dp x pp x tp mesh (the workers): global ranks 0 .. mesh_size-1."""
        return self.dp * self.pp * self.tp

    @property
    def world_size(self) -> int:
        """Processes this plan needs: the mesh's, and the parameter servers' after them."""
        return self.mesh_size + self.server_count

    def check_world(self, world_size: int) -> None:
        """Refuse a plan whose mesh does not cover exactly `world_size` processes."""
        if self.world_size != world_size:
            if self.sync == "ps":
                raise PlanError(
                    f"Plan dp + servers = {self.dp} + {self.server_count} = {self.world_size} "
                    f"does not match {world_size} processes; launch {self.world_size} "
                    f"processes, or use dp + servers == {world_size}"
                )
            rest = self.pp * self.tp
            fix = f"dp={world_size // rest}, " if world_size % rest == 0 else ""
            raise PlanError(
                f"Plan dp*pp*tp = {self.dp}*{self.pp}*{self.tp} = {self.world_size} does not match "
                f"{world_size} processes; use {fix}a plan whose dp*pp*tp == {world_size}, "
                f"or launch {self.world_size} processes"
            )

    def check_batch(self, batch_size: int) -> None:
        """Refuse a global batch that does not split into dp replicas of micro_batches each."""
        need = self.dp * self.micro_batches
        if batch_size % need != 0:
            closest = max(need, round(batch_size / need) * need)
            raise PlanError(
                f"global batch {batch_size} is not divisible by dp*micro_batches = "
                f"{self.dp}*{self.micro_batches} = {need}; use a batch size that is a multiple "
                f"of {need} (e.g. {closest}) or fewer micro_batches"
            )

    def describe(self) -> str:
        """A short label such as 'dp2 pp2 tp1 m4 1f1b'."""
        text = f"dp{self.dp} pp{self.pp} tp{self.tp}"
        if self.pp > 1 or self.micro_batches > 1:
            text += f" m{self.micro_batches}"
        if self.pp > 1:
            text += f" {self.schedule}"
            text += f" v{self.virtual_stages}" if self.schedule == "interleaved" else ""
        if self.recompute != "never":
            text += f" recompute={self.recompute}"
        if self.ep > 1:
            text += f" ep{self.ep}"
            if self.capacity_factor is not None:
                text += f" capacity{self.capacity_factor}"
        if self.zero:
            text += f" zero{self.zero}"
        for name in ("compress", "compress_transfers", "offload"):
            if getattr(self, name) != "none":
                text += f" {name}={getattr(self, name)}"
        if self.precision != "fp32":
            text += f" {self.precision}"
        if self.reduce_dtype != "fp32":
            text += f" reduce={self.reduce_dtype}"
        if self.sync == "ps":
            text += f" ps{self.server_count} staleness{self.staleness}"
        return text

    def as_dict(self) -> dict[str, object]:
        """The plan as plain JSON-ready values."""
        return {
            "dp": self.dp,
            "pp": self.pp,
            "tp": self.tp,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "stages": list(self.stages) if self.stages else None,
            "split_points": list(self.split_points) if self.split_points else None,
            "recompute": self.recompute,
            "tp_plan": dict(self.tp_plan) if self.tp_plan else None,
            "ep": self.ep,
            "capacity_factor": self.capacity_factor,
            "ep_plan": dict(self.ep_plan) if self.ep_plan else None,
            "zero": self.zero,
            "compress": self.compress,
            "compress_transfers": self.compress_transfers,
            "offload": self.offload,
            "memory_budget": self.memory_budget,
            "reserve_memory": self.reserve_memory,
            "nonfinite": self.nonfinite,
            "precision": self.precision,
            "reduce_dtype": self.reduce_dtype,
            "sync": self.sync,
            "servers": self.servers,
            "staleness": self.staleness,
        }


def _positive(value: object) -> bool:
    """A positive int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
