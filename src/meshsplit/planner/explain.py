"""One sentence per losing plan: the term of its step that lost it against the best plan.

The term is the one with the largest excess over the best plan's same term; the sentence
gives that term's seconds and, for communication, the bytes behind them, e.g.
"tp=4: 22.0 MiB of activation all-reduce over tp per step, about 41 ms, against 12 ms of
compute saved (step 95 ms, best 60 ms)". Where the two plans split the experts differently
(Plan.ep), a clause weighs the all-to-alls against the gradient all-reduce they save, or
says what the best plan's expert split holds, sums and sends. Under parameter servers the
dp sentence names the push and pull instead of the all-reduce.
"""

from __future__ import annotations

from meshsplit.memory.tracker import format_bytes
from meshsplit.plan import Plan
from meshsplit.planner.cost import TERMS, Prediction
from meshsplit.planner.machine import Machine

__all__: list[str] = []


TIE = 0.005
"""Plans within this fraction of the best's step time are called as fast."""


def _ms(seconds: float) -> str:
    value = seconds * 1e3
    if value < 1:
        return f"{value * 1e3:.0f} us"
    return f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"


def losing_term(row: Prediction, best: Prediction) -> str:
    """The term in which `row` spends the most more than `best`."""
    return max(TERMS, key=lambda term: row.terms[term] - best.terms[term])


def reason(row: Prediction, best: Prediction, machine: Machine) -> str:
    """Why `row` is slower than `best`, in one sentence."""
    plan, terms = row.plan, row.terms
    if row.step_time_s <= best.step_time_s * (1 + TIE):
        return (
            f"{plan.describe()}: predicted as fast as the best ({_ms(row.step_time_s)}); "
            "the best has fewer moving parts or holds less memory"
        )
    term = losing_term(row, best)
    saved = best.terms["compute"] - terms["compute"]
    saving = f"against {_ms(saved)} of compute saved" if saved > 0 else "with no compute saved"
    sentences = {
        "communication_tp": (
            f"{format_bytes(row.bytes_per_step['tp'])} of activation all-reduce and all-gather "
            f"over tp={plan.tp} per step, about {_ms(terms['communication_tp'])}, {saving}"
        ),
        "communication_dp": (
            f"{format_bytes(row.bytes_per_step['dp'])} of gradients pushed to "
            f"{plan.server_count} parameter server(s) per worker per step and the parameters "
            f"pulled back, about {_ms(terms['communication_dp'])}, none of it behind backward"
            if plan.sync == "ps"
            else f"{format_bytes(row.bytes_per_step['dp'])} of gradient all-reduce over "
            f"dp={plan.dp} per step, {_ms(terms['communication_dp'])} of it not hidden behind "
            "backward"
        ),
        "communication_ep": (
            f"{format_bytes(row.bytes_per_step['ep'])} of tokens sent to their experts and "
            f"back by all-to-all over ep={plan.ep} per step, about "
            f"{_ms(terms['communication_ep'])}"
        ),
        "communication_pp": (
            f"{format_bytes(row.bytes_per_step['pp'])} of activations and their gradients "
            f"between stages per step, about {_ms(terms['communication_pp'])} of waiting"
        ),
        "bubble": (
            f"a pipeline bubble of {_ms(terms['bubble'])} "
            f"({100 * terms['bubble'] / row.step_time_s:.0f}% of its step) with "
            f"{plan.micro_batches} micro-batches over {plan.pp} stages ({_schedule(plan)})"
        ),
        "recompute": (f"recomputing the forward ({plan.recompute}) adds {_ms(terms['recompute'])}"),
        "compute": (
            f"its slowest rank computes for {_ms(terms['compute'])} against "
            f"{_ms(best.terms['compute'])} on the best plan's"
        ),
        "sharing": (
            f"{plan.mesh_size} workers share {machine.cores} cores, "
            f"{_ms(terms['sharing'])} beyond its critical path"
        ),
        "optimizer": (
            f"the optimizer step takes {_ms(terms['optimizer'])} against "
            f"{_ms(best.terms['optimizer'])}"
        ),
        "overhead": (
            f"the engine's own work and the exchange that ends each step take "
            f"{_ms(terms['overhead'])}"
        ),
    }
    return (
        f"{plan.describe()}: {sentences[term]}{_expert_split(row, best, term)} "
        f"(step {_ms(row.step_time_s)}, best {_ms(best.step_time_s)})"
    )


def _schedule(plan: Plan) -> str:
    """The schedule as the bubble sentence names it: interleaving's chunks per rank too."""
    if plan.virtual_stages > 1:
        return f"{plan.schedule}, {plan.virtual_stages} chunks per rank"
    return plan.schedule


def _expert_split(row: Prediction, best: Prediction, term: str) -> str:
    """What splitting the experts more (or less) than the best plan costs and saves `row`
    (empty: the same ep). `term` is the one the sentence already gives."""
    ep, best_ep = row.plan.ep, best.plan.ep
    if ep > best_ep:
        saved = best.terms["communication_dp"] - row.terms["communication_dp"]
        against = (
            f"against {_ms(saved)} of gradient all-reduce saved"
            if saved > 0
            else "with no gradient all-reduce saved"
        )
        if term == "communication_ep":
            return f", {against}"
        return (
            f"; its all-to-alls over ep={ep} send {format_bytes(row.bytes_per_step['ep'])} of "
            f"tokens, about {_ms(row.terms['communication_ep'])}, {against}"
        )
    if ep < best_ep:
        holders = best.plan.dp // best_ep
        summed = f"sums their gradients over {holders} ranks" if holders > 1 else "sums none"
        return (
            f"; the best holds 1/{best_ep} of the experts per rank, {summed} and sends "
            f"{format_bytes(best.bytes_per_step['ep'])} of tokens by all-to-all, about "
            f"{_ms(best.terms['communication_ep'])}"
        )
    return ""
