"""Our estimate beside the analytic formulas, category by category, with one line per large difference.

Each line says what the formula assumes and what the trace holds instead (bytes per parameter and dtype
for model states; per-layer activations in units of s·b·h bytes; the tensors that make up the logits and
the loss; what "other" is at the peak), so the reason for a gap can be read off, not guessed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from tabulate import tabulate

from analysis.categories import Category, CategoryProfile, categorized_lifetimes, category_profile
from analysis.formulas import FormulaEstimate, ModelShape
from analysis.liveness import Lifetime
from analysis.peak import Timeline
from analysis.report import MemoryReport
from tracer.graph import StepGraph, StorageRow
from tracer.modules import enclosing_block
from tracer.units import format_bytes, format_count

LARGE_SHARE = 0.05  # a difference, or a category a formula leaves out, this share of the peak gets a line
MODEL_STATES = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATES)
ATTENTION_NAMES = ("attn", "attention")
MLP_NAMES = ("mlp", "feed_forward", "ffn", "experts", "moe")
TOP_TENSORS = 3
OUTSIDE_LAYERS = "outside"
LAYER_PARTS = ("attention", "MLP", "norms and residuals")
OPTIMIZER_STATE_NOTES = {
    "adamw": "momentum and variance in the weights' dtype, no separate master copy",
    "adam": "momentum and variance in the weights' dtype, no separate master copy",
    "adamw8bit": "8-bit momentum and variance with fp32 block scales",
}


@dataclass(frozen=True)
class Fact:
    brief: str  # the part that explains a gap, for the difference lines
    detail: str  # where the category is largest and what it is made of, for the table


NONE = Fact("none", "none")


@dataclass(frozen=True)
class Comparison:
    report: MemoryReport
    profile: CategoryProfile
    formulas: list[FormulaEstimate]
    facts: dict[Category, Fact]  # what the trace holds in each category, in words
    shape: ModelShape
    explanations: list[str]


def compare(
    report: MemoryReport, step: StepGraph, line: Timeline, shape: ModelShape, formulas: list[FormulaEstimate]
) -> Comparison:
    spans = categorized_lifetimes(step)
    profile = category_profile(step, line, report.peak_op_index, spans)
    facts = _Facts(report, step, shape, profile, spans).all()
    explanations = _explanations(report, step, profile, formulas, facts)
    return Comparison(report, profile, formulas, facts, shape, explanations)


def _explanations(
    report: MemoryReport,
    step: StepGraph,
    profile: CategoryProfile,
    formulas: list[FormulaEstimate],
    facts: dict[Category, Fact],
) -> list[str]:
    """Lines keyed by their text, so that formulas with the same gap for the same reason share one."""
    peak = report.peak_bytes
    large = LARGE_SHARE * peak
    lines: dict[str, list[str]] = defaultdict(list)
    for formula in formulas:
        if not formula.terms:
            lines[f"not for this setup: {formula.why_not}"].append(formula.name)
    for category in Category:
        ours, at_peak = profile.largest[category], profile.at_peak[category]
        for formula in formulas:
            if not formula.terms:
                continue
            term = formula.terms.get(category)
            if term is None and category in formula.accounts_for and at_peak >= large:
                up_to = f", up to {format_bytes(ours)}" if ours > at_peak else ""
                text = (
                    f"{category.value} not counted: {format_bytes(at_peak)} at the peak ({100 * at_peak / peak:.0f}% "
                    f"of it){up_to}; {facts[category].brief}"
                )
                lines[text].append(formula.name)
            elif term is not None and abs(term.bytes - ours) >= large:
                text = (
                    f"{category.value} {format_bytes(term.bytes)} for {term.assumes}; the trace holds "
                    f"{format_bytes(ours)}, {facts[category].brief}"
                )
                lines[text].append(formula.name)
    result = [f"- {_names(names)}: {text}." for text, names in lines.items()]
    summed = profile.largest_sum()
    if summed - peak >= large:
        op = step.ops[report.peak_op_index]
        moments = ", ".join(
            f"{category.value} in the {step.ops[index].phase.value}"
            for category, index in profile.largest_at.items()
            if category in (Category.GRADIENTS, Category.ACTIVATIONS, Category.LOGITS_AND_LOSS)
            and profile.largest[category]
        )
        result.append(
            f"- The categories are largest at different moments ({moments}): adding each one's largest, as a "
            f"sum of formulas does, gives {format_bytes(summed)}, {100 * (summed - peak) / peak:.0f}% above the "
            f"peak, which is in the {report.peak_phase} at {op.target}{f' in {op.module}' if op.module else ''}."
        )
    return result


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


class _Facts:
    """What the trace holds in each category, from the storages live where that category is largest."""

    def __init__(
        self,
        report: MemoryReport,
        step: StepGraph,
        shape: ModelShape,
        profile: CategoryProfile,
        spans: list[tuple[Lifetime, Category]],
    ) -> None:
        self.report, self.step, self.shape, self.profile, self.spans = report, step, shape, profile, spans

    def all(self) -> dict[Category, Fact]:
        facts = {category: self.model_state(category) for category in MODEL_STATES}
        facts[Category.ACTIVATIONS] = self.activations()
        facts[Category.LOGITS_AND_LOSS] = self.logits()
        facts[Category.OTHER] = self.other()
        return facts

    def live(self, category: Category) -> list[tuple[int, StorageRow]]:
        index = self.profile.largest_at[category]
        return [
            (span.bytes, self.step.storages[span.storage_id])
            for span, kind in self.spans
            if kind is category and span.first <= index <= span.last
        ]

    def at(self, category: Category) -> str:
        index = self.profile.largest_at[category]
        return f"at op {index + 1:,} ({self.step.ops[index].phase.value}): "

    def model_state(self, category: Category) -> Fact:
        live = self.live(category)
        if not live:
            return NONE
        report, setup = self.report, self.report.setup
        total = sum(size for size, _ in live)
        if category is Category.PARAMETERS:
            text = f"{total / report.parameter_count:.1f} bytes per parameter, {_dtype_mix(live)}"
        else:
            text = f"{total / report.trainable_parameter_count:.1f} bytes per trainable parameter, {_dtype_mix(live)}"
        if category is not Category.PARAMETERS and report.trainable_parameter_count < report.parameter_count:
            text += (
                f", for the {format_count(report.trainable_parameter_count)} trainable of "
                f"{format_count(report.parameter_count)} parameters"
            )
        brief = text if report.layout.plain else f"{text}, this GPU's share"
        if category is Category.PARAMETERS:
            text += self.precision_note()
        if category is Category.OPTIMIZER_STATES and setup.optimizer in OPTIMIZER_STATE_NOTES:
            text += f" ({OPTIMIZER_STATE_NOTES[setup.optimizer]})"
        return Fact(
            brief, text if report.layout.plain else f"{text}, this GPU's share under {report.layout.describe()}"
        )

    def precision_note(self) -> str:
        recipe = self.report.assumptions.get("mixed_precision_recipe")
        if recipe:
            return f" ({recipe})"
        if self.report.setup.autocast_dtype:
            return " (torch.amp autocast keeps fp32 weights and casts them per op)"
        return ""

    def activations(self) -> Fact:
        live = self.live(Category.ACTIVATIONS)
        if not live:
            return NONE
        setup = self.report.setup
        parts: dict[str, int] = defaultdict(int)
        blocks = set(self.step.structure.blocks)
        for size, row in live:
            parts[_layer_part(row.module, blocks)] += size
        per_sbh = max(len(blocks), 1) * setup.seq_len * setup.batch_size * self.shape.hidden
        in_layers = sum(size for part, size in parts.items() if part != OUTSIDE_LAYERS) / per_sbh
        by_part = ", ".join(f"{part} {parts[part] / per_sbh:.1f}" for part in LAYER_PARTS)
        scores = sum(size for size, row in live if _is_score(row, setup.seq_len))
        scores_text = f"{format_bytes(scores)} of s x s attention scores" if scores else "no s x s attention scores"
        brief = f"{in_layers:.1f}sbh per layer, {_dtype_mix(live)}, {scores_text}"
        return Fact(
            brief,
            f"{self.at(Category.ACTIVATIONS)}{in_layers:.1f}sbh per layer ({by_part}), "
            f"{format_bytes(parts[OUTSIDE_LAYERS])} outside the layers; {_dtype_mix(live)}; {scores_text}"
            + ("" if scores else f" ({setup.attn} attention saves its output and log-sum-exp)"),
        )

    def logits(self) -> Fact:
        live = self.live(Category.LOGITS_AND_LOSS)
        if not live:
            return NONE
        tensors = _top_tensors(self.step, live)
        return Fact(tensors, f"{self.at(Category.LOGITS_AND_LOSS)}{tensors}; vocabulary {self.shape.vocab:,}")

    def other(self) -> Fact:
        live = self.live(Category.OTHER)
        slack = self.profile.largest[Category.OTHER] - sum(size for size, _ in live)
        parts = [_top_tensors(self.step, live, with_role=True)] if live else []
        if slack:
            parts.append(f"{format_bytes(slack)} of allocator blocks beyond the requests")
        if not parts:
            return NONE
        text = ", ".join(parts)
        return Fact(text, f"{self.at(Category.OTHER)}{text}")


def _layer_part(module: str, blocks: set[str]) -> str:
    block = enclosing_block(module, blocks)
    if block is None:
        return OUTSIDE_LAYERS
    inner = module[len(block) + 1 :].split(".")
    if any(key in name for name in inner for key in ATTENTION_NAMES):
        return "attention"
    if any(key in name for name in inner for key in MLP_NAMES):
        return "MLP"
    return "norms and residuals"


def _is_score(row: StorageRow, seq_len: int) -> bool:
    return len(row.shape) == 4 and row.shape[-2:] == (seq_len, seq_len)


def _dtype_mix(live: list[tuple[int, StorageRow]]) -> str:
    """``bfloat16``, or ``83% bfloat16 and 17% float32``; strategies' flat buffers carry no dtype."""
    by_dtype: dict[str, int] = defaultdict(int)
    for size, row in live:
        by_dtype[row.dtype or "flat buffers"] += size
    total = sum(by_dtype.values())
    shown = [(dtype, size) for dtype, size in by_dtype.items() if size >= 0.01 * total]
    shown.sort(key=lambda item: item[1], reverse=True)
    if len(shown) == 1:
        return shown[0][0]
    return " and ".join(f"{100 * size / total:.0f}% {dtype}" for dtype, size in shown)


def _top_tensors(step: StepGraph, live: list[tuple[int, StorageRow]], with_role: bool = False) -> str:
    """The largest groups by the op that made them and dtype: ``2.000 GiB _log_softmax (float32)``, or with
    the role first: ``29.915 GiB temporaries (_foreach_sqrt, float32)``."""
    groups: dict[str, int] = defaultdict(int)
    for size, row in live:
        made_by = _short(step.ops[row.producer].target) if row.producer is not None else "(before the step)"
        if with_role:
            label = f"{row.role.value} ({made_by}, {row.dtype})" if row.producer is not None else row.role.value
        else:
            label = f"{made_by} ({row.dtype})"
        groups[label] += size
    ordered = sorted(groups.items(), key=lambda item: item[1], reverse=True)[:TOP_TENSORS]
    return ", ".join(f"{format_bytes(size)} {label}" for label, size in ordered)


def _short(target: str) -> str:
    """``aten._log_softmax.default`` -> ``_log_softmax``."""
    parts = target.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == "aten" else target


def render_comparison(comparison: Comparison) -> str:
    report, profile = comparison.report, comparison.profile
    peak = report.peak_bytes
    layout, setup = report.layout, report.setup
    scope = "one GPU" if layout.plain else f"per GPU, {layout.describe()}"
    formulas = comparison.formulas
    rows = [
        [category.value, _size(profile.at_peak[category]), _size(profile.largest[category])]
        + [_cell(formula, category) for formula in formulas]
        for category in Category
    ]
    rows.append(["total", _size(peak), ""] + ["n/a" if f.total is None else _size(f.total) for f in formulas])
    rows.append(
        ["vs our peak", "", ""]
        + ["" if f.total is None else f"{100 * (f.total - peak) / peak:+.1f}%" for f in formulas]
    )
    headers = ["", "ours at peak", "ours largest", *(formula.name for formula in formulas)]
    return "\n".join(
        [
            f"{report.model_id}: ours beside the analytic formulas, {scope}, batch {setup.batch_size} x "
            f"{setup.seq_len:,} tokens",
            "",
            tabulate(rows, headers=headers, colalign=("left", *["right"] * (len(headers) - 1))),
            "",
            "ours largest: each category's most at any op of the step; -: not in the formula; "
            f"sbh: seq x batch x hidden = {setup.seq_len * setup.batch_size * comparison.shape.hidden:,} bytes",
            "",
            "In the trace, where each category is largest:",
            tabulate(
                [(category.value, fact.detail) for category, fact in comparison.facts.items()],
                tablefmt="plain",
                maxcolwidths=[None, 100],
            ),
            "",
            "Large differences (5% of the peak or more):" if comparison.explanations else "No large differences.",
            *comparison.explanations,
            "",
            "Formulas:",
            *(f"  {formula.name}: {formula.source}" for formula in formulas),
        ]
    )


def _size(nbytes: int) -> str:
    return format_bytes(nbytes, decimals=1)


def _cell(formula: FormulaEstimate, category: Category) -> str:
    if not formula.terms:
        return "n/a"
    term = formula.terms.get(category)
    return "-" if term is None else _size(term.bytes)


def comparison_json(comparison: Comparison) -> dict[str, Any]:
    profile = comparison.profile
    return {
        "ours": comparison.report.to_json(),
        "categories": {
            category.value: {
                "at_peak_bytes": profile.at_peak[category],
                "largest_bytes": profile.largest[category],
                "largest_at_op_index": profile.largest_at[category],
                "trace": comparison.facts[category].detail,
            }
            for category in Category
        },
        "formulas": [formula.to_json() for formula in comparison.formulas],
        "explanations": comparison.explanations,
    }
