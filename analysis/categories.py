"""The step's memory in the categories the analytic formulas use: model states, activations, the logits.

The roles (tracer/roles.py) say what a storage is for; the formulas cut memory differently: they count
the activations a transformer layer saves for backward apart from the output layer's logits and the loss,
and they count nothing of temporaries, buffers or the allocator. ``category_of`` maps one to the other,
and ``category_profile`` gives each category at the peak and at its own largest.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from analysis.liveness import Lifetime, lifetimes
from analysis.peak import Timeline, live_bytes
from tracer.graph import StepGraph, StorageRow
from tracer.modules import LOOP
from tracer.roles import Phase, Role
from tracer.trace import ModelStructure, Op


class Category(str, Enum):
    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER_STATES = "optimizer states"
    ACTIVATIONS = "activations"  # saved for backward by the layers, embeddings and final norm
    LOGITS_AND_LOSS = "logits and loss"  # the output layer's logits, the loss and their gradients
    OTHER = "other"  # temporaries, buffers, inputs, workspaces, communication, allocator slack


_BY_ROLE = {
    Role.PARAMETER: Category.PARAMETERS,
    Role.GRADIENT: Category.GRADIENTS,
    Role.OPTIMIZER_STATE: Category.OPTIMIZER_STATES,
    Role.ACTIVATION: Category.ACTIVATIONS,
}
_TRAINING_PHASES = (Phase.FORWARD, Phase.BACKWARD)


def category_of(row: StorageRow, producer: Op | None, structure: ModelStructure) -> Category:
    """``producer`` is the op that made the storage (None if it existed before the step); its module, not
    the row's, places storages a strategy added.

    Logits and loss are what the output layer makes and what the module holding it makes itself (the
    loss: ``float()`` upcast, ``log_softmax``, ``nll_loss``), in forward and in backward."""
    if (
        row.role in (Role.ACTIVATION, Role.TEMPORARY)
        and producer is not None
        and producer.phase in _TRAINING_PHASES
        and _in_head(producer.module, structure)
    ):
        return Category.LOGITS_AND_LOSS
    return _BY_ROLE.get(row.role, Category.OTHER)


def _in_head(module: str, structure: ModelStructure) -> bool:
    """Made by the output layer, by the model around it (``""``; ``base_model.model`` under peft), or by the
    loop's own loss outside the model."""
    output = structure.output_embedding
    if module == LOOP or not output:
        return module in ("", LOOP)
    return module in (output, output.rpartition(".")[0]) or module.startswith(output + ".")


@dataclass(frozen=True)
class CategoryProfile:
    at_peak: dict[Category, int]  # sums to the peak
    largest: dict[Category, int]  # each category's most live bytes at any op of the step
    largest_at: dict[Category, int]  # the op where it is largest

    def largest_sum(self) -> int:
        """What adding every category's largest gives, as the formulas do."""
        return sum(self.largest.values())


def categorized_lifetimes(step: StepGraph) -> list[tuple[Lifetime, Category]]:
    result = []
    for span in lifetimes(step):
        row = step.storages[span.storage_id]
        producer = step.ops[row.producer] if row.producer is not None else None
        result.append((span, category_of(row, producer, step.structure)))
    return result


def category_timeline(step: StepGraph, line: Timeline, spans: list[tuple[Lifetime, Category]]) -> np.ndarray:
    """live[i, c]: bytes of ``Category`` c live at op i, on the same rounding as ``line`` (its allocator slack
    is counted in ``OTHER``), so every row sums to the line's total."""
    categories = list(Category)
    columns = [categories.index(category) for _, category in spans]
    live = live_bytes([span for span, _ in spans], columns, len(step.ops), len(categories))
    live[:, categories.index(Category.OTHER)] += line.live[:, line.roles.index(Role.ALLOCATOR_SLACK)]
    return live


def category_profile(
    step: StepGraph, line: Timeline, peak_index: int, spans: list[tuple[Lifetime, Category]] | None = None
) -> CategoryProfile:
    """``spans``: the step's :func:`categorized_lifetimes`, when the caller has them already."""
    live = category_timeline(step, line, categorized_lifetimes(step) if spans is None else spans)
    largest_at = live.argmax(axis=0)
    return CategoryProfile(
        at_peak={category: int(live[peak_index, c]) for c, category in enumerate(Category)},
        largest={category: int(live[largest_at[c], c]) for c, category in enumerate(Category)},
        largest_at={category: int(largest_at[c]) for c, category in enumerate(Category)},
    )
