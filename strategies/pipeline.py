"""Pipeline parallelism as ``torch.distributed.pipelining`` runs it (torch 2.13), for one stage.

The decoder layers are split contiguously over ``P`` stages, the first ``layers % P`` stages taking one more
(torchtitan's ``pipeline_llama_manual_split``); stage 0 also holds the token embedding, the last stage the final
norm, the output layer and the loss. Every stage runs the model's parameter-free modules around the layers
(positions, mask, rotary embedding) for itself, and every rank holds the whole batch. A step runs ``M``
microbatches of ``batch_size`` through the schedule, then the optimizer step on the stage's parameters:
``ScheduleGPipe`` runs every forward, then every backward; ``Schedule1F1B`` runs ``min(M, P - s)`` forwards,
then a backward and a forward in turn, then the remaining backwards (schedules.py ``_step_microbatches``).

The stage's step is built from the traced single-GPU step of two micro-steps of gradient accumulation: the
first microbatch runs the first micro-step's ops (its backward creates the gradients), every other one the
second's (its backward adds into them). Each forward and backward of a microbatch is a copy of the stage's ops
of that micro-step, with storages of its own: what a forward saves lives until that microbatch's backward, a
pass's temporaries within it. What the runtime adds (stage.py):

* receive buffers, one per microbatch for the activations (stages after the first) and one for their gradient
  (stages before the last), made at the first step and kept (``_make_tensor_from_meta``); the stage's input is
  the buffer itself, made a leaf that requires grad, so what reads the hidden state another stage made reads it;
* the stage's output (the hidden state sent on, or the last stage's logits), kept in ``fwd_cache`` until its
  microbatch's backward and by the schedule's ``output`` variable until the next forward returns;
* the gradient of the stage's input, held for its send until the next backward starts (GPipe's ``ops``) or is
  done (1F1B's ``bwd_sends``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from tracer.errors import UserError
from tracer.graph import StepGraph, StorageRow, replaced
from tracer.modules import LOOP, enclosing_block, within
from tracer.roles import Phase, Role
from tracer.trace import ModelStructure, Op
from tracer.training import TrainingSetup

SCHEDULES = ("gpipe", "1f1b")
FORWARD, BACKWARD = "F", "B"
RECEIVE_BUFFER = "pipeline receive buffer"
Action = tuple[str, int]  # (FORWARD or BACKWARD, microbatch)


def layer_split(layers: int, stages: int, split: tuple[int, ...] | None = None) -> list[range]:
    """Contiguous layers per stage: ``split`` layers each, else even, the first ``layers % stages`` stages taking
    one more (torchtitan's default split points)."""
    if split is None:
        base, extra = divmod(layers, stages)
        split = tuple(base + (stage < extra) for stage in range(stages))
    ranges, start = [], 0
    for count in split:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def schedule_actions(schedule: str, stages: int, stage: int, microbatches: int) -> list[Action]:
    """The forwards and backwards of ``stage``, in the order its schedule runs them."""
    if schedule == "gpipe":
        return [(FORWARD, mb) for mb in range(microbatches)] + [(BACKWARD, mb) for mb in range(microbatches)]
    warmup = min(microbatches, stages - stage)
    actions = [(FORWARD, mb) for mb in range(warmup)]
    for mb in range(microbatches):
        actions.append((BACKWARD, mb))
        if warmup + mb < microbatches:
            actions.append((FORWARD, warmup + mb))
    return actions


@dataclass(frozen=True)
class PipelinePlan:
    stages: int
    stage: int
    schedule: str = "1f1b"
    microbatches: int = 1
    split: tuple[int, ...] | None = None  # decoder layers per stage; None: even

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


@dataclass(frozen=True)
class PipelineParallel:
    """The runtime of ``--pp``: ``PipelineStage`` per rank under ``ScheduleGPipe`` or ``Schedule1F1B``, the loop's
    loss divided by the microbatches (torchtitan's ``scale_grads=False``), ``return_outputs=False``."""

    stages: int
    schedule: str
    microbatches: int
    split: tuple[int, ...] | None = None  # decoder layers per stage; None: even

    def dominant_stages(self, step: StepGraph) -> list[int]:
        """Stages no other stage holds more than: all of them, but for 1F1B over an even split of decoder layers
        that run alike after the first, where stage 1 holds at least what every later stage but the last does (as
        many layers or more, one more microbatch in flight, the same buffers), so the first, the second and the
        last stand for all."""
        if self.schedule != "1f1b" or self.split is not None or not _alike_after_the_first(step):
            return list(range(self.stages))
        return sorted({0, min(1, self.stages - 1), self.stages - 1})

    @property
    def note(self) -> str:
        split = (
            f"layers split {'+'.join(map(str, self.split))}"
            if self.split
            else "layers split contiguously (earlier stages take the extra layer)"
        )
        return (
            f"torch.distributed.pipelining, {self.schedule}, {self.microbatches} microbatches of the batch size per "
            f"step; {split}, embedding on the first stage, final norm, output layer and loss on the last; a receive "
            "buffer per microbatch for activations and for their gradients"
        )

    def check(self, setup: TrainingSetup, config) -> None:
        """Refuse what the stage's step cannot be built for."""
        if setup.grad_accum > 1:
            raise UserError(
                "--grad-accum with --pp: the microbatches are the pipeline's accumulation; give --microbatches "
                f"{setup.grad_accum * self.microbatches} instead."
            )
        if setup.keep_outputs or setup.accelerate_prepared:
            raise UserError("--keep-outputs and --accelerate-prepared are loops of one model, not a pipeline's.")
        layers = getattr(config, "num_hidden_layers", None)
        if layers is not None:  # a custom model's layers are counted when its traced step is split
            self._check_layers(layers)

    def traced_setup(self, setup: TrainingSetup) -> TrainingSetup:
        """Two micro-steps: the first microbatch's passes, and any other's. A stage's forward keeps no key/value
        cache."""
        return dataclasses.replace(setup, grad_accum=2, use_cache=False)

    def _check_layers(self, layers: int) -> None:
        if self.stages > layers:
            raise UserError(f"--pp {self.stages}: more stages than the model's {layers} decoder layers.")
        if self.split is not None and sum(self.split) != layers:
            raise UserError(
                f"--pp-split {','.join(map(str, self.split))} gives {sum(self.split)} decoder layers, and the model "
                f"has {layers}: the stages' counts must add up to it."
            )

    def apply(self, step: StepGraph, stage: int) -> StepGraph:
        self._check_layers(len(step.structure.blocks))
        return pipeline_stage(step, PipelinePlan(self.stages, stage, self.schedule, self.microbatches, self.split))


def _alike_after_the_first(step: StepGraph) -> bool:
    """Whether every decoder layer after the first runs the same ops (their kinds: attention, MLP or experts)."""
    blocks = step.structure.blocks
    runs: dict[str, list[str]] = defaultdict(list)
    for op in step.ops:
        if op.phase is Phase.FORWARD:
            block = enclosing_block(op.module, blocks)
            if block is not None:
                runs[block].append(op.target)
    return len({tuple(runs[block]) for block in blocks[1:]}) <= 1


def pipeline_stage(step: StepGraph, plan: PipelinePlan) -> StepGraph:
    """The step of stage ``plan.stage``, from a traced step of two micro-steps."""
    return _Stage(step, plan).build()


class _Stage:
    def __init__(self, step: StepGraph, plan: PipelinePlan) -> None:
        micro_steps = step.micro_steps()
        if len(micro_steps) != 2:
            raise ValueError("pipeline stages are built from a step traced with two micro-steps")
        self.step, self.plan = step, plan
        structure = step.structure
        layers = layer_split(len(structure.blocks), plan.stages, plan.split)[plan.stage]
        self.blocks = tuple(structure.blocks[i] for i in layers)
        self.parameter_modules = {
            row.param.rpartition(".")[0] for row in step.storages.values() if row.role is Role.PARAMETER and row.param
        }
        # The model whose forward computes the logits and the loss (the output layer's parent: transformers'
        # ForCausalLM, under peft's wrappers too); its own ops, and its wrappers', run on the last stage.
        self.head = (structure.output_embedding or "").rpartition(".")[0]
        # The stage's ops of each pass of each traced micro-step, and the optimizer's.
        self.passes: dict[Action, list[int]] = defaultdict(list)
        self.optimizer: list[int] = []
        for number, ops in enumerate(micro_steps):
            for index in ops:
                op = step.ops[index]
                if op.phase is Phase.OPTIMIZER:
                    self.optimizer.append(index)
                elif self._owns(op.module):
                    self.passes[(FORWARD if op.phase is Phase.FORWARD else BACKWARD, number)].append(index)
        self.pass_of = {index: key for key, ops in self.passes.items() for index in ops}
        self.micro_step = {index: number for number, ops in enumerate(micro_steps) for index in ops}
        # The stage's parameters: those of the modules it runs, and any other its ops read (an output layer tied to
        # the embedding: the last stage keeps a copy, as torchtitan's pruned model does).
        read = {s for index in self.pass_of for s in step.ops[index].inputs}
        self.params = {
            row.param
            for row in step.storages.values()
            if row.role is Role.PARAMETER and row.param and (row.id in read or self._owns(row.param.rpartition(".")[0]))
        }

    def _owns(self, module: str) -> bool:
        """Ops of the stage's layers; of the embedding on the first stage; of the final norm, the output layer
        and the loss (the model's top level, or the loop's) on the last; of the model's parameter-free modules
        (positions, masks, rotary embedding) on every stage."""
        structure = self.step.structure
        block = enclosing_block(module, structure.blocks)
        if block is not None:
            return block in self.blocks
        embedding = structure.input_embedding
        if embedding and within(module, embedding):
            return self.plan.first
        if module == LOOP or module in self.parameter_modules or within(self.head, module):
            return self.plan.last
        return True

    def _made_elsewhere(self, storage_id: int) -> bool:
        """Made by another stage: the hidden state passed in, or the gradient passed back."""
        row = self.step.storages[storage_id]
        return row.producer is not None and row.producer not in self.pass_of and row.producer not in self.optimizer

    def build(self) -> StepGraph:
        step, plan = self.step, self.plan
        actions = schedule_actions(plan.schedule, plan.stages, plan.stage, plan.microbatches)
        # The first microbatch runs the first traced micro-step's ops, the others the second's.
        template = {action: (action[0], 0 if action[1] == 0 else 1) for action in actions}
        position: dict[tuple[Action, int], int] = {}  # (action, traced op) -> op index in the stage's step
        ops: list[Op] = []
        span: dict[Action, range] = {}
        for action in actions:
            start = len(ops)
            for index in self.passes[template[action]]:
                position[(action, index)] = len(ops)
                ops.append(replaced(step.ops[index], pipeline_pass=(plan.stage, action[1])))
            span[action] = range(start, len(ops))
        optimizer_at = {index: len(ops) + n for n, index in enumerate(self.optimizer)}
        ops += [step.ops[index] for index in self.optimizer]
        self.actions, self.span, self.position, self.optimizer_at = actions, span, position, optimizer_at

        rows: dict[int, StorageRow] = {}
        ids: dict[tuple[Action | None, int], int] = {}

        def add(row: StorageRow, owner: Action | None, producer: int | None, freed: int | None) -> None:
            ids[(owner, row.id)] = len(rows)
            rows[len(rows)] = replaced(row, id=len(rows), producer=producer, freed_after=freed, users=())

        for row in self._existing():
            add(row, None, None, None)
        for row in step.storages.values():
            if row.producer in optimizer_at and (row.param is None or row.param in self.params):
                freed = None if row.freed_after is None else optimizer_at.get(row.freed_after, len(ops) - 1)
                add(row, None, optimizer_at[row.producer], freed)
            elif row.producer in self.pass_of:
                output = self._is_output(row)
                for action in actions:
                    if template[action] == self.pass_of[row.producer]:
                        add(row, action, position[(action, row.producer)], self._freed(row, action, output))
        buffers = self._receive_buffers(rows)

        users: dict[int, list[int]] = defaultdict(list)
        stage_ops = []
        owner_of = {index: action for action, indices in span.items() for index in indices}
        for index, op in enumerate(ops):
            action = owner_of.get(index)

            def mapped(storage_id: int, action=action) -> int | None:
                """The copy an op of ``action`` reads or writes: its own, its microbatch's forward's, one that
                exists for the whole step, or the receive buffer standing for another stage's."""
                for owner in (action, action and (FORWARD, action[1]), None):
                    if (owner, storage_id) in ids:
                        return ids[(owner, storage_id)]
                if action is not None and self._made_elsewhere(storage_id):
                    return buffers.get((step.ops[step.storages[storage_id].producer].phase, action[1]))
                return None

            inputs = tuple(s for s in map(mapped, op.inputs) if s is not None)
            outputs = tuple(s for s in map(mapped, op.outputs) if s is not None)
            for storage_id in inputs:
                users[storage_id].append(index)
            stage_ops.append(replaced(op, index=index, inputs=inputs, outputs=outputs))
        rows = {i: replaced(row, users=tuple(users.get(i, ()))) for i, row in rows.items()}
        structure = ModelStructure(
            blocks=self.blocks,
            input_embedding=step.structure.input_embedding if plan.first else "",
            output_embedding=step.structure.output_embedding if plan.last else None,
            tp_plan=step.structure.tp_plan,
            model_class=step.structure.model_class,
        )
        return StepGraph(ops=stage_ops, storages=rows, structure=structure)

    def _existing(self) -> list[StorageRow]:
        """What exists before the step: the stage's parameters and their optimizer states, the buffers of the
        modules it runs, the whole batch (every rank loads it; the schedule splits it into views), and the rest
        (library workspaces, the GradScaler's state)."""
        kept = []
        for row in self.step.storages.values():
            if row.producer is not None:
                continue
            if row.role is Role.INPUT:
                kept.append(replaced(row, nbytes=row.nbytes * self.plan.microbatches))
            elif row.param is not None:
                if row.param in self.params:
                    kept.append(row)
            elif row.role is not Role.BUFFER or self._owns(row.name.rpartition(".")[0]):
                kept.append(row)  # the modules' buffers it runs; workspaces and the GradScaler's state
        return kept

    def _freed_in_forward(self, row: StorageRow) -> bool:
        """Freed by the forward of the micro-step that made it (by another stage's ops: when that stage's forward
        would have dropped it, this stage's has returned). A later micro-step's freeing it means the loss's graph
        held it, which dies with this microbatch's backward."""
        freed = self.step.ops[row.freed_after]
        return freed.phase is Phase.FORWARD and self.micro_step[row.freed_after] == self.micro_step[row.producer]

    def _sent(self, row: StorageRow) -> bool:
        """A gradient another stage's backward reads: the gradient of this stage's input."""
        return any(user not in self.pass_of and self.step.ops[user].phase is Phase.BACKWARD for user in row.users)

    def _is_output(self, row: StorageRow) -> bool:
        """The stage's output: a hidden state the next stage's forward reads, or the last stage's logits (what the
        output layer makes and the loss reads, not its autocast copies of its weight and input)."""
        if self.step.ops[row.producer].phase is not Phase.FORWARD:
            return False
        forward_users = [self.step.ops[user] for user in row.users if self.step.ops[user].phase is Phase.FORWARD]
        if self.plan.last:
            output = self.step.structure.output_embedding
            return row.module == output and any(not within(op.module, output) for op in forward_users)
        return any(op.index not in self.pass_of for op in forward_users)

    def _receive_buffers(self, rows: dict[int, StorageRow]) -> dict[tuple[Phase, int], int]:
        """One receive buffer per microbatch for each kind of tensor another stage makes and this one reads:
        made in forward (the activations), made in backward (their gradient)."""
        sizes: dict[Phase, StorageRow] = {}
        for index in self.passes[(FORWARD, 1)] + self.passes[(BACKWARD, 1)]:
            for storage_id in self.step.ops[index].inputs:
                if self._made_elsewhere(storage_id):
                    row = self.step.storages[storage_id]
                    sizes.setdefault(self.step.ops[row.producer].phase, row)
        buffers = {}
        for phase, row in sizes.items():
            what = "activations" if phase is Phase.FORWARD else "gradients"
            for mb in range(self.plan.microbatches):
                storage_id = len(rows)
                name = f"{RECEIVE_BUFFER}: {what}, microbatch {mb}"
                rows[storage_id] = StorageRow(
                    storage_id, row.nbytes, row.dtype, row.shape, Role.COMMUNICATION, None, None, (), "", True, name
                )
                buffers[(phase, mb)] = storage_id
        return buffers

    def _freed(self, row: StorageRow, action: Action, output: bool) -> int | None:
        """Where a storage of ``action``'s pass is freed in the stage's step."""
        kind, mb = action
        backward = self.span[(BACKWARD, mb)]
        if output:
            return max(backward[-1], self._held_by_output_variable(action))
        if row.freed_after is None:
            return None
        if (action, row.freed_after) in self.position:  # within the pass
            return self.position[(action, row.freed_after)]
        if kind == FORWARD and ((BACKWARD, mb), row.freed_after) in self.position:  # saved for its backward
            return self.position[((BACKWARD, mb), row.freed_after)]
        if row.freed_after in self.optimizer_at and (row.role is Role.GRADIENT or self.plan.last):
            # gradients until zero_grad; what the loss's graph holds, while the last stage keeps each loss
            # (``_internal_losses``); elsewhere the graph dies with the microbatch's backward
            return self.optimizer_at[row.freed_after]
        if kind == BACKWARD:  # the gradient of the stage's input, sent back; anything else dies with the pass
            return self._held_for_send(action) if self._sent(row) else self.span[action][-1]
        if self._freed_in_forward(row):  # by another stage's forward in the trace: here when the forward returns
            return self.span[action][-1]
        return backward[-1]

    def _later(self, action: Action, kind: str) -> Action | None:
        following = self.actions[self.actions.index(action) + 1 :]
        return next((a for a in following if a[0] == kind), None)

    def _passes_end(self) -> int:
        return min(self.optimizer_at.values()) - 1 if self.optimizer_at else max(i[-1] for i in self.span.values())

    def _held_by_output_variable(self, action: Action) -> int:
        """The schedule's ``output`` holds a forward's result until the next forward returns."""
        following = self._later(action, FORWARD)
        return self.span[following][-1] if following else self._passes_end()

    def _held_for_send(self, action: Action) -> int:
        """GPipe rebinds its send ops when the next backward starts, 1F1B its ``bwd_sends`` when it is done."""
        following = self._later(action, BACKWARD)
        if following is None:
            return self._passes_end()
        if self.plan.schedule == "gpipe":
            return self.span[following][0] - 1
        return self.span[following][-1]
