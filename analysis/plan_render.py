"""The plan as a ranked table with one recommendation and its reason, or as JSON."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from analysis.plan import AS_FAST_WITHIN, Outcome, Plan
from analysis.steptime import COMPUTE_EFFICIENCY, MEMORY_EFFICIENCY, NETWORK_EFFICIENCY
from tracer.units import GIB, format_bytes


def render_plan(plan: Plan) -> str:
    gpu = plan.cluster.gpu
    numbers = _note_numbers(plan)
    pipelined = any(outcome.candidate.layout.pp > 1 for outcome in plan.outcomes)
    batch = f", global batch {plan.global_batch}" if plan.global_batch else ", largest micro-batch, no accumulation"
    lines = [
        f"{plan.model_id} on {plan.gpus} x {gpu.description} ({format_bytes(gpu.memory_bytes, 2)}), sequence "
        f"{plan.setup.seq_len:,}{batch}",
        f"Fits: {plan.budget.describe()}.",
        *_routing(plan),
        "",
        tabulate(
            [_row(rank, outcome, numbers, pipelined) for rank, outcome in enumerate(plan.outcomes, 1)],
            headers=[
                "#",
                "layout",
                "micro-batch",
                "accum",
                "GiB/GPU",
                "step s",
                "tokens/s",
                "comm exposed s",
                *(["bubble s"] if pipelined else []),
            ],
            colalign=("right", "left", *("right",) * (7 if pipelined else 6)),
        ),
        *(["", *(f"[{number}] {note}" for note, number in numbers.items())] if numbers else []),
        *([FLOOR_NOTE] if any(outcome.needed_is_floor for outcome in plan.outcomes) else []),
        "",
        *_recommendation(plan),
        "",
        f"Step time: a roofline per traced op at {COMPUTE_EFFICIENCY:.0%} of peak FLOP/s and "
        f"{MEMORY_EFFICIENCY:.0%} of memory bandwidth, plus collectives at {NETWORK_EFFICIENCY:.0%} of "
        f"{gpu.interconnect} ({plan.cluster.gpus_per_node} GPUs per node, {plan.cluster.internode_gbps:g} GB/s "
        "between nodes), overlapped as each runtime overlaps them (docs/how-it-works.md: the step-time model).",
    ]
    not_considered = [*_left_out(plan), *plan.skipped]
    if not_considered:
        lines += ["Not considered:", *(f"  {reason}" for reason in not_considered)]
    return "\n".join(lines)


def _left_out(plan: Plan) -> list[str]:
    """The layouts left out by their ceilings, one line per checkpointing mode."""
    modes: dict[str | None, list[float]] = {}
    for candidate, ceiling in plan.slower.items():
        modes.setdefault(candidate.checkpointing, []).append(ceiling)
    lines = []
    for checkpointing, ceilings in modes.items():
        count = f"{len(ceilings)} layout{'s' if len(ceilings) > 1 else ''}"
        mode = f" with {checkpointing} checkpointing" if checkpointing else ""
        low, high = f"{min(ceilings):,.0f}", f"{max(ceilings):,.0f}"
        span = high if low == high else f"{low} to {high}"
        lines.append(
            f"{count}{mode}: at most {span} tokens/s with every op at its roofline, below the "
            f"{plan.best.tokens_per_second:,.0f} of the fastest layout found (--exhaustive searches them)"
        )
    return lines


def _routing(plan: Plan) -> list[str]:
    """What the expert-parallel layouts assume of the routing, when there are any."""
    imbalance = next((o.candidate.layout.routing_imbalance for o in plan.outcomes if o.candidate.layout.ep > 1), None)
    if imbalance is None:
        return []
    if imbalance == 1:
        return ["Expert parallel: balanced routing, each GPU's experts receiving their share of the routed tokens."]
    return [
        f"Expert parallel: the busiest GPU's experts receive {imbalance:g} times their share of the routed tokens "
        "(--routing-imbalance); that GPU is the one planned."
    ]


FLOOR = ">="  # what a layout needs, known only by its floor (Outcome.needed_is_floor)
FLOOR_NOTE = (
    f"{FLOOR}: the allocated peak plus the CUDA context, already over the budget; the caching allocator's replay, "
    "which can only add to it, was not run"
)


def _row(rank: int, outcome: Outcome, notes_index: dict[str, int], pipelined: bool) -> list[Any]:
    notes = "".join(f" [{notes_index[note]}]" for note in outcome.notes)
    if not outcome.fits:
        needed = f"{FLOOR if outcome.needed_is_floor else ''}{outcome.needed_bytes / GIB:.1f} at {outcome.needed_at}"
        row = ["-", outcome.candidate.describe() + notes, "none", "", needed, "", "out of memory", ""]
        return row + ([""] if pipelined else [])
    time = outcome.time
    row = [
        rank,
        outcome.candidate.describe() + notes,
        outcome.micro_batch,
        outcome.accumulation,
        f"{outcome.needed_bytes / GIB:.1f}",
        f"{time.total_s:.2f}",
        f"{outcome.tokens_per_second:,.0f}",
        f"{time.exposed_communication_s + time.host_transfer_s:.2f}",
    ]
    return row + ([f"{time.pipeline_bubble_s:.2f}"] if pipelined else [])


def _note_numbers(plan: Plan) -> dict[str, int]:
    notes = sorted({note for outcome in plan.outcomes for note in outcome.notes})
    return {note: number for number, note in enumerate(notes, 1)}


def _recommendation(plan: Plan) -> list[str]:
    best = plan.best
    if best is None:
        smallest = min(plan.outcomes, key=lambda o: o.needed_bytes)
        lines = [
            f"Nothing fits: the least memory-hungry layout, {smallest.candidate.describe()}, needs "
            f"{format_bytes(smallest.needed_bytes)} per GPU at micro-batch 1, "
            f"{format_bytes(smallest.needed_bytes - plan.budget.usable_bytes)} over the budget."
        ]
        if plan.suggestions:
            lines += ["What would fit:", *(f"  {s}" for s in plan.suggestions)]
        else:
            lines.append("Neither 8x the GPUs under FSDP2 nor LoRA would fit one sequence: shorten --seq-len.")
        return lines
    time = best.time
    accumulation = f" x {best.accumulation} accumulation steps" if best.accumulation > 1 else ""
    lines = [
        f"Recommended: {best.candidate.describe()}, micro-batch {best.micro_batch}{accumulation}: "
        f"{best.tokens_per_second:,.0f} tokens/s, {time.total_s:.2f} s per step, "
        f"{format_bytes(best.needed_bytes)} per GPU.",
    ]
    ddp = next(
        (
            o
            for o in plan.outcomes
            if o.candidate.layout.zero == 0
            and o.candidate.layout.tp == 1
            and o.candidate.layout.ep == 1
            and not o.candidate.checkpointing
        ),
        None,
    )
    if ddp is not None and ddp is not best:
        name = ddp.candidate.describe()
        if not ddp.fits:
            over = format_bytes(ddp.needed_bytes - plan.budget.usable_bytes)
            by = f"at least {over}" if ddp.needed_is_floor else over
            lines.append(f"  {name} runs out of memory at micro-batch 1 by {by}.")
        else:
            lines.append(f"  {name} fits micro-batch {ddp.micro_batch} but is {_slower(ddp, best):.0%} slower.")
    runner_up = next((o for o in plan.outcomes[1:] if o.fits and o is not ddp), None)
    if runner_up is not None and _slower(runner_up, best) < AS_FAST_WITHIN:
        lines.append(f"  {runner_up.candidate.describe()} is as fast within {AS_FAST_WITHIN:.0%}.")
    elif runner_up is not None:
        lines.append(
            f"  {runner_up.candidate.describe()} is {_slower(runner_up, best):.0%} slower: {_why(runner_up, best)}."
        )
    return lines


def _slower(other: Outcome, best: Outcome) -> float:
    return best.tokens_per_second / other.tokens_per_second - 1


def _why(other: Outcome, best: Outcome) -> str:
    """The part of the step time per token that grows most from ``best`` to ``other``."""

    def per_token(outcome: Outcome) -> dict[str, float]:
        time = outcome.time
        tokens = outcome.tokens_per_second * time.total_s
        compute = time.micro_steps * (time.forward_s + time.backward_s)
        return {
            "compute": compute / tokens,
            "optimizer": time.optimizer_s / tokens,
            "communication": time.exposed_communication_s / tokens,
            "host": time.host_transfer_s / tokens,
        }

    mine, theirs = per_token(other), per_token(best)
    part = max(mine, key=lambda key: mine[key] - theirs[key])
    if part == "compute" and other.candidate.checkpointing and not best.candidate.checkpointing:
        return "it recomputes every layer's forward in backward"
    if part == "compute":
        return f"its micro-batch of {other.micro_batch} keeps each GPU less busy per token"
    if part == "optimizer":
        where = "on the host" if other.candidate.layout.offload else "unsharded"
        return f"its optimizer step runs {where} ({other.time.optimizer_s:.2f} s per step)"
    if part == "host":
        return f"it waits {other.time.host_transfer_s:.2f} s per step for PCIe copies"
    return (
        f"{other.time.exposed_communication_s:.2f} s of its communication per step is not hidden behind compute "
        f"(vs {best.time.exposed_communication_s:.2f} s)"
    )


def plan_json(plan: Plan) -> dict[str, Any]:
    return {
        "model": plan.model_id,
        "gpus": plan.gpus,
        "gpu": plan.cluster.gpu.__dict__,
        "gpus_per_node": plan.cluster.gpus_per_node,
        "internode_gbps": plan.cluster.internode_gbps,
        "usable_bytes": plan.budget.usable_bytes,
        "margin": plan.budget.margin,
        "global_batch": plan.global_batch,
        "setup": plan.setup.to_json(),
        "recommended": _outcome_json(plan.best) if plan.best else None,
        "candidates": [_outcome_json(outcome) for outcome in plan.outcomes],
        "not_considered": plan.skipped,
        "slower": [
            {
                "layout": candidate.layout.to_json(),
                "checkpointing": candidate.checkpointing,
                "description": candidate.describe(),
                "ceiling_tokens_per_second": ceiling,
            }
            for candidate, ceiling in plan.slower.items()
        ],
        "suggestions": plan.suggestions,
    }


def _outcome_json(outcome: Outcome) -> dict[str, Any]:
    return {
        "layout": outcome.candidate.layout.to_json(),
        "checkpointing": outcome.candidate.checkpointing,
        "description": outcome.candidate.describe(),
        "fits": outcome.fits,
        "micro_batch": outcome.micro_batch,
        "accumulation": outcome.accumulation,
        "needed_bytes": outcome.needed_bytes,
        "needed_bytes_is_floor": outcome.needed_is_floor,
        "peak_allocated_bytes": outcome.report.peak_bytes if outcome.report else None,
        "step_time": outcome.time.to_json() if outcome.time else None,
        "tokens_per_second": outcome.tokens_per_second,
        "notes": outcome.notes,
    }
