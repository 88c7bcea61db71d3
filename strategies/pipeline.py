"""Pipeline parallelism as ``torch.distributed.pipelining`` runs it (torch 2.13), for one rank of the pipeline.

The decoder layers are split contiguously over the pipeline's stages, the first ``layers % stages`` stages taking
one more (torchtitan's ``pipeline_llama_manual_split``); stage 0 also holds the token embedding, the last stage
the final norm, the output layer and the loss. Every stage runs the model's parameter-free modules around the
layers (positions, mask, rotary embedding) for itself, and every rank holds the whole batch. ``ScheduleGPipe`` and
``Schedule1F1B`` give each of ``P`` ranks one stage; ``ScheduleInterleaved1F1B`` gives each ``V`` stages, rank
``r`` holding stages ``r, r + P, ..., r + (V - 1) P`` (``generate_stage_to_rank_mapping``'s loop). A step runs
``M`` microbatches of ``batch_size`` through the schedule, then the optimizer step on the rank's parameters:
``ScheduleGPipe`` runs every forward, then every backward; ``Schedule1F1B`` runs ``min(M, P - s)`` forwards, then
a backward and a forward in turn, then the remaining backwards (schedules.py ``_step_microbatches``);
``ScheduleInterleaved1F1B`` runs the order its ``_calculate_single_rank_operations`` computes (depth first: a
round of ``P`` microbatches through one local stage, then the next), transcribed in :func:`interleaved_actions`.

The rank's step is built from the traced single-GPU step of two micro-steps of gradient accumulation: the
first microbatch runs the first micro-step's ops (its backward creates the gradients), every other one the
second's (its backward adds into them). Each forward and backward of a microbatch through a stage is a copy of
the stage's ops of that micro-step, with storages of its own: what a forward saves lives until that
microbatch's backward, a pass's temporaries within it. What the runtime adds (stage.py):

* receive buffers, one per stage and microbatch for the activations (stages after the first) and one for their
  gradient (stages before the last), made at the first step and kept (``_make_tensor_from_meta``); the stage's
  input is the buffer itself, made a leaf that requires grad, so what reads the hidden state another stage made
  reads it;
* the stage's output (the hidden state sent on, or the last stage's logits), kept in ``fwd_cache`` until its
  microbatch's backward; ``ScheduleGPipe`` and ``Schedule1F1B`` also hold it in their ``output`` variable until
  the next forward returns (the interleaved runtime's is local to the action);
* the gradient of the stage's input, held for its send until the next backward starts (GPipe's ``ops``), is done
  (1F1B's ``bwd_sends``), or, in the interleaved runtime, until its send action, which follows the backward.
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

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
LOOPED = ("interleaved-1f1b",)  # several stages per rank, run by torch's _PipelineScheduleRuntime
FORWARD, BACKWARD = "F", "B"
RECEIVE_BUFFER = "pipeline receive buffer"
Action = tuple[str, int, int]  # (FORWARD or BACKWARD, stage, microbatch)
TIED_EMBEDDINGS = (
    "--pp with an output layer tied to the input embedding (tie_word_embeddings) is not modelled yet: the first "
    "stage holds the embedding and the last the output layer, each a copy of the shared weight whose gradient gets "
    "only its own stage's share, which no reference here checks."
)


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


def rank_stages(ranks: int, rank: int, stages_per_rank: int) -> list[int]:
    """The stages ``rank`` holds, in the loop torch maps them to ranks (stage ``s`` on rank ``s % ranks``)."""
    return [rank + local * ranks for local in range(stages_per_rank)]


def schedule_actions(schedule: str, ranks: int, rank: int, microbatches: int, stages_per_rank: int = 1) -> list[Action]:
    """The forwards and backwards of ``rank``'s stages, in the order its schedule runs them."""
    if schedule == "interleaved-1f1b":
        return interleaved_actions(ranks, rank, microbatches, stages_per_rank)
    if schedule == "gpipe":
        return [(kind, rank, mb) for kind in (FORWARD, BACKWARD) for mb in range(microbatches)]
    warmup = min(microbatches, ranks - rank)
    actions = [(FORWARD, rank, mb) for mb in range(warmup)]
    for mb in range(microbatches):
        actions.append((BACKWARD, rank, mb))
        if warmup + mb < microbatches:
            actions.append((FORWARD, rank, warmup + mb))
    return actions


def interleaved_rounds(ranks: int, microbatches: int) -> int:
    """Rounds of ``ScheduleInterleaved1F1B``: one per ``ranks`` microbatches, at least one."""
    return max(1, microbatches // ranks)


def schedule_takes(schedule: str, ranks: int, microbatches: int) -> bool:
    """Whether the schedule runs this many microbatches: ``ScheduleInterleaved1F1B`` a multiple of its rounds."""
    return schedule not in LOOPED or microbatches % interleaved_rounds(ranks, microbatches) == 0


def interleaved_actions(ranks: int, rank: int, microbatches: int, stages_per_rank: int) -> list[Action]:
    """``ScheduleInterleaved1F1B._calculate_single_rank_operations`` (torch 2.13 schedules.py, with
    ``_get_warmup_ops`` and ``_get_1f1b_rank_ops``), its idle slots left out: warm-up forwards (two more for each
    rank before the last), then a forward and a backward in turn, then the remaining backwards; each round of
    microbatches goes through one local stage before the next (forwards in stage order, backwards in reverse)."""
    per_round = microbatches // interleaved_rounds(ranks, microbatches)
    total = stages_per_rank * microbatches
    warmup = min((stages_per_rank - 1) * per_round + 2 * (ranks - 1 - rank), total)

    def forward_stage(op: int) -> int:
        return (op // per_round) % stages_per_rank * ranks + rank

    def backward_stage(op: int) -> int:
        return (stages_per_rank - 1 - ((op - warmup) // per_round) % stages_per_rank) * ranks + rank

    next_forward: dict[int, int] = defaultdict(int)
    next_backward: dict[int, int] = defaultdict(int)
    actions: list[Action] = []
    for op in range(total + warmup):
        if op < total:
            stage = forward_stage(op)
            actions.append((FORWARD, stage, next_forward[stage]))
            next_forward[stage] += 1
        if op >= warmup:
            stage = backward_stage(op)
            actions.append((BACKWARD, stage, next_backward[stage]))
            next_backward[stage] += 1
    return actions


@dataclass(frozen=True)
class PipelinePlan:
    ranks: int
    rank: int
    schedule: str = "1f1b"
    microbatches: int = 1
    split: tuple[int, ...] | None = None  # decoder layers per stage; None: even
    stages_per_rank: int = 1

    @property
    def stages(self) -> list[int]:
        return rank_stages(self.ranks, self.rank, self.stages_per_rank)

    @property
    def stage_count(self) -> int:
        return self.ranks * self.stages_per_rank


@dataclass(frozen=True)
class PipelineParallel:
    """The runtime of ``--pp``: ``PipelineStage`` per stage under ``ScheduleGPipe``, ``Schedule1F1B`` or
    ``ScheduleInterleaved1F1B`` (``stages_per_rank`` stages on each of ``ranks``), the loop's loss divided by the
    microbatches (torchtitan's ``scale_grads=False``), ``return_outputs=False``."""

    ranks: int
    schedule: str
    microbatches: int
    split: tuple[int, ...] | None = None  # decoder layers per stage; None: even
    stages_per_rank: int = 1

    @property
    def stage_count(self) -> int:
        return self.ranks * self.stages_per_rank

    def dominant_ranks(self, step: StepGraph) -> list[int]:
        """Ranks no other rank holds more than: all of them, but for 1F1B and interleaved 1F1B over an even split
        of decoder layers that run alike after the first, where rank 1 holds at least what every later rank but the
        last does (as many layers or more; its warm-up runs more forwards, so more microbatches are in flight; the
        same buffers), so the first, the second and the last stand for all."""
        if self.schedule == "gpipe" or self.split is not None or not _alike_after_the_first(step):
            return list(range(self.ranks))
        return sorted({0, min(1, self.ranks - 1), self.ranks - 1})

    @property
    def note(self) -> str:
        split = (
            f"layers split {'+'.join(map(str, self.split))}"
            if self.split
            else "layers split contiguously (earlier stages take the extra layer)"
        )
        stages = (
            f"{self.stage_count} stages, {self.stages_per_rank} per rank (stage s on rank s mod {self.ranks}); "
            if self.stages_per_rank > 1
            else ""
        )
        return (
            f"torch.distributed.pipelining, {self.schedule}, {self.microbatches} microbatches of the batch size per "
            f"step; {stages}{split}, embedding on the first stage, final norm, output layer and loss on the last; a "
            "receive buffer per stage and microbatch for activations and for their gradients"
        )

    def check(self, setup: TrainingSetup, config) -> None:
        """Refuse what the rank's step cannot be built for."""
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
        if getattr(config, "tie_word_embeddings", False):
            raise UserError(TIED_EMBEDDINGS)

    def traced_setup(self, setup: TrainingSetup) -> TrainingSetup:
        """Two micro-steps: the first microbatch's passes, and any other's. A stage's forward keeps no key/value
        cache."""
        return dataclasses.replace(setup, grad_accum=2, use_cache=False)

    def _check_layers(self, layers: int) -> None:
        if self.stage_count > layers:
            per_rank = f" x {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""
            raise UserError(f"--pp {self.ranks}{per_rank}: more stages than the model's {layers} decoder layers.")
        if self.split is not None and sum(self.split) != layers:
            raise UserError(
                f"--pp-split {','.join(map(str, self.split))} gives {sum(self.split)} decoder layers, and the model "
                f"has {layers}: the stages' counts must add up to it."
            )

    def apply(self, step: StepGraph, rank: int) -> StepGraph:
        self._check_layers(len(step.structure.blocks))
        output = step.structure.output_embedding
        params = (row.param for row in step.storages.values() if row.role is Role.PARAMETER and row.param)
        if output and not any(within(param, output) for param in params):
            raise UserError(TIED_EMBEDDINGS)
        plan = PipelinePlan(self.ranks, rank, self.schedule, self.microbatches, self.split, self.stages_per_rank)
        return pipeline_rank(step, plan)


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


def pipeline_rank(step: StepGraph, plan: PipelinePlan) -> StepGraph:
    """The step of pipeline rank ``plan.rank``, from a traced step of two micro-steps."""
    return _RankStep(step, plan).build()


Pass = tuple[str, int, int]  # (FORWARD or BACKWARD, traced micro-step, stage): the traced ops an action copies


class _RankStep:
    def __init__(self, step: StepGraph, plan: PipelinePlan) -> None:
        micro_steps = step.micro_steps()
        if len(micro_steps) != 2:
            raise ValueError("pipeline stages are built from a step traced with two micro-steps")
        self.step, self.plan = step, plan
        structure = step.structure
        split = layer_split(len(structure.blocks), plan.stage_count, plan.split)
        self.blocks = {stage: tuple(structure.blocks[i] for i in split[stage]) for stage in plan.stages}
        self.first, self.last = 0 in self.blocks, plan.stage_count - 1 in self.blocks
        self.parameter_modules = {
            row.param.rpartition(".")[0] for row in step.storages.values() if row.role is Role.PARAMETER and row.param
        }
        # The model whose forward computes the logits and the loss (the output layer's parent: transformers'
        # ForCausalLM, under peft's wrappers too); its own ops, and its wrappers', run on the last stage.
        self.head = (structure.output_embedding or "").rpartition(".")[0]
        # The ops of each stage's passes of each traced micro-step (an op of the modules every stage runs is in
        # each of them), and the optimizer's.
        self.passes: dict[Pass, list[int]] = defaultdict(list)
        self.stage_ops: dict[int, set[int]] = defaultdict(set)
        self.optimizer: list[int] = []
        runners: dict[str, list[int]] = {}  # per module: thousands of ops, a few hundred modules
        for number, ops in enumerate(micro_steps):
            for index in ops:
                op = step.ops[index]
                if op.phase is Phase.OPTIMIZER:
                    self.optimizer.append(index)
                    continue
                kind = FORWARD if op.phase is Phase.FORWARD else BACKWARD
                if op.module not in runners:
                    runners[op.module] = self._runners(op.module)
                for stage in runners[op.module]:
                    self.passes[(kind, number, stage)].append(index)
                    self.stage_ops[stage].add(index)
        self.optimizer_ops = set(self.optimizer)
        self.micro_step = {index: number for number, ops in enumerate(micro_steps) for index in ops}
        # The rank's parameters: those of the modules it runs, and any other its ops read (an output layer tied to
        # the embedding: the last stage keeps a copy, as torchtitan's pruned model does).
        read = {s for ops in self.stage_ops.values() for index in ops for s in step.ops[index].inputs}
        self.params = {
            row.param
            for row in step.storages.values()
            if row.role is Role.PARAMETER and row.param and (row.id in read or self._runs(row.param.rpartition(".")[0]))
        }

    def _runners(self, module: str) -> list[int]:
        """The rank's stages that run ``module``: a layer's stage; the first stage the embedding; the last the
        final norm, the output layer and the loss (the model's top level, or the loop's); every stage the model's
        parameter-free modules (positions, masks, rotary embedding)."""
        structure = self.step.structure
        block = enclosing_block(module, structure.blocks)
        if block is not None:
            return [stage for stage, blocks in self.blocks.items() if block in blocks]
        embedding = structure.input_embedding
        if embedding and within(module, embedding):
            return [0] if self.first else []
        output = structure.output_embedding
        head = module == LOOP or module in self.parameter_modules or within(self.head, module)
        if head or (output and within(module, output)):  # an output layer tied to the embedding owns no parameter
            return [self.plan.stage_count - 1] if self.last else []
        return list(self.blocks)

    def _runs(self, module: str) -> bool:
        return bool(self._runners(module))

    def _made_elsewhere(self, storage_id: int, stage: int) -> bool:
        """Made by another stage: the hidden state passed in, or the gradient passed back."""
        producer = self.step.storages[storage_id].producer
        return producer is not None and producer not in self.stage_ops[stage] and producer not in self.optimizer_ops

    def build(self) -> StepGraph:
        step, plan = self.step, self.plan
        actions = schedule_actions(plan.schedule, plan.ranks, plan.rank, plan.microbatches, plan.stages_per_rank)
        # The first microbatch runs the first traced micro-step's ops, the others the second's.
        template = {action: (action[0], 0 if action[2] == 0 else 1, action[1]) for action in actions}
        copies: dict[Pass, list[Action]] = defaultdict(list)  # the actions that copy each traced pass
        for action in actions:
            copies[template[action]].append(action)
        position: dict[tuple[Action, int], int] = {}  # (action, traced op) -> op index in the rank's step
        ops: list[Op] = []  # the traced ops the rank's step runs, in its order
        span: dict[Action, range] = {}
        for action in actions:
            start = len(ops)
            for index in self.passes[template[action]]:
                position[(action, index)] = len(ops)
                ops.append(step.ops[index])
            span[action] = range(start, len(ops))
        optimizer_at = {index: len(ops) + n for n, index in enumerate(self.optimizer)}
        ops += [step.ops[index] for index in self.optimizer]
        self.actions, self.span, self.position, self.optimizer_at = actions, span, position, optimizer_at

        placed: list[tuple[StorageRow, int | None, int | None]] = []  # each rank row's traced row, producer, freeing
        ids: dict[Action | int | None, dict[int, int]] = defaultdict(dict)  # owner -> traced storage -> rank row

        def add(row: StorageRow, owner: Action | int | None, producer: int | None, freed: int | None) -> None:
            ids[owner][row.id] = len(placed)
            placed.append((row, producer, freed))

        for owner, row in self._existing():
            add(row, owner, None, None)
        for row in step.storages.values():
            if row.producer is None:
                continue
            if row.producer in optimizer_at:
                if row.param is None or row.param in self.params:
                    freed = None if row.freed_after is None else optimizer_at.get(row.freed_after, len(ops) - 1)
                    add(row, None, optimizer_at[row.producer], freed)
                continue
            kind = FORWARD if step.ops[row.producer].phase is Phase.FORWARD else BACKWARD
            for stage in plan.stages:
                if row.producer in self.stage_ops[stage]:
                    output = self._is_output(row, stage)
                    for action in copies[(kind, self.micro_step[row.producer], stage)]:
                        add(row, action, position[(action, row.producer)], self._freed(row, action, output))
        buffers = self._receive_buffers(placed)

        users: dict[int, list[int]] = defaultdict(list)
        stage_ops = []
        for action, indices in [*span.items(), (None, range(len(ops) - len(optimizer_at), len(ops)))]:
            # The copy an op of ``action`` reads or writes: its own, its microbatch's forward's, its stage's, one
            # that exists for the whole step (the later ones win), or the receive buffer standing for another
            # stage's.
            if action is None:
                copy = ids[None]
            else:
                copy = {**ids[None], **ids[action[1]], **ids[(FORWARD, *action[1:])], **ids[action]}

            def mapped(storage_id: int, action=action, copy=copy) -> int | None:
                found = copy.get(storage_id)
                if found is None and action is not None and self._made_elsewhere(storage_id, action[1]):
                    phase = step.ops[step.storages[storage_id].producer].phase
                    return buffers.get((action[1], phase, action[2]))
                return found

            run_in = None if action is None else (action[1], action[2])
            for index in indices:
                op = ops[index]
                inputs = tuple(s for s in map(mapped, op.inputs) if s is not None)
                outputs = tuple(s for s in map(mapped, op.outputs) if s is not None)
                for storage_id in inputs:
                    users[storage_id].append(index)
                stage_ops.append(replaced(op, index=index, inputs=inputs, outputs=outputs, pipeline_pass=run_in))
        rows = {
            i: replaced(row, id=i, producer=producer, freed_after=freed, users=tuple(users.get(i, ())))
            for i, (row, producer, freed) in enumerate(placed)
        }
        structure = ModelStructure(
            blocks=tuple(block for stage in plan.stages for block in self.blocks[stage]),
            input_embedding=step.structure.input_embedding if self.first else "",
            output_embedding=step.structure.output_embedding if self.last else None,
            tp_plan=step.structure.tp_plan,
            model_class=step.structure.model_class,
        )
        return StepGraph(ops=stage_ops, storages=rows, structure=structure)

    def _existing(self) -> list[tuple[int | None, StorageRow]]:
        """What exists before the step, with the stage owning a copy of its own (None: the rank's one): the rank's
        parameters and their optimizer states, the buffers of the modules its stages run (each stage its own of
        the modules every stage runs), the whole batch (every rank loads it; the schedule splits it into views),
        and the rest (library workspaces, the GradScaler's state)."""
        kept: list[tuple[int | None, StorageRow]] = []
        for row in self.step.storages.values():
            if row.producer is not None:
                continue
            if row.role is Role.INPUT:
                kept.append((None, replaced(row, nbytes=row.nbytes * self.plan.microbatches)))
            elif row.param is not None:
                if row.param in self.params:
                    kept.append((None, row))
            elif row.role is not Role.BUFFER:
                kept.append((None, row))  # workspaces and the GradScaler's state
            else:
                runners = self._runners(row.name.rpartition(".")[0])
                kept += [(stage if len(runners) > 1 else None, row) for stage in runners]
        return kept

    def _freed_in_forward(self, row: StorageRow) -> bool:
        """Freed by the forward of the micro-step that made it (by another stage's ops: when that stage's forward
        would have dropped it, this stage's has returned). A later micro-step's freeing it means the loss's graph
        held it, which dies with this microbatch's backward."""
        freed = self.step.ops[row.freed_after]
        return freed.phase is Phase.FORWARD and self.micro_step[row.freed_after] == self.micro_step[row.producer]

    def _sent(self, row: StorageRow, stage: int) -> bool:
        """A gradient another stage's backward reads: the gradient of this stage's input."""
        ops = self.stage_ops[stage]
        return any(user not in ops and self.step.ops[user].phase is Phase.BACKWARD for user in row.users)

    def _is_output(self, row: StorageRow, stage: int) -> bool:
        """The stage's output: a hidden state the next stage's forward reads, or the last stage's logits (what the
        output layer makes and the loss reads, not its autocast copies of its weight and input)."""
        if self.step.ops[row.producer].phase is not Phase.FORWARD:
            return False
        users = (self.step.ops[user] for user in row.users)
        forward_users = (op for op in users if op.phase is Phase.FORWARD)  # thousands for the rotary embedding's
        if stage == self.plan.stage_count - 1:
            output = self.step.structure.output_embedding
            return row.module == output and any(not within(op.module, output) for op in forward_users)
        ops = self.stage_ops[stage]
        return any(op.index not in ops for op in forward_users)

    def _receive_buffers(
        self, placed: list[tuple[StorageRow, int | None, int | None]]
    ) -> dict[tuple[int, Phase, int], int]:
        """One receive buffer per stage and microbatch for each kind of tensor another stage makes and this one
        reads: made in forward (the activations), made in backward (their gradient)."""
        buffers = {}
        for stage in self.plan.stages:
            sizes: dict[Phase, StorageRow] = {}
            for index in self.passes[(FORWARD, 1, stage)] + self.passes[(BACKWARD, 1, stage)]:
                for storage_id in self.step.ops[index].inputs:
                    if self._made_elsewhere(storage_id, stage):
                        row = self.step.storages[storage_id]
                        sizes.setdefault(self.step.ops[row.producer].phase, row)
            of_stage = f", stage {stage}" if self.plan.stages_per_rank > 1 else ""
            for phase, row in sizes.items():
                what = "activations" if phase is Phase.FORWARD else "gradients"
                for mb in range(self.plan.microbatches):
                    storage_id = len(placed)
                    name = f"{RECEIVE_BUFFER}: {what}, microbatch {mb}{of_stage}"
                    buffer = StorageRow(
                        storage_id, row.nbytes, row.dtype, row.shape, Role.COMMUNICATION, None, None, (), "", True, name
                    )
                    placed.append((buffer, None, None))
                    buffers[(stage, phase, mb)] = storage_id
        return buffers

    def _freed(self, row: StorageRow, action: Action, output: bool) -> int | None:
        """Where a storage of ``action``'s pass is freed in the rank's step."""
        kind, stage, mb = action
        backward = self.span[(BACKWARD, stage, mb)]
        if output:
            return max(backward[-1], self._held_by_output_variable(action))
        if row.freed_after is None:
            return None
        if (action, row.freed_after) in self.position:  # within the pass
            return self.position[(action, row.freed_after)]
        if kind == FORWARD and ((BACKWARD, stage, mb), row.freed_after) in self.position:  # saved for its backward
            return self.position[((BACKWARD, stage, mb), row.freed_after)]
        if row.freed_after in self.optimizer_at and (row.role is Role.GRADIENT or stage == self.plan.stage_count - 1):
            # gradients until zero_grad; what the loss's graph holds, while the last stage keeps each loss
            # (``_internal_losses``); elsewhere the graph dies with the microbatch's backward
            return self.optimizer_at[row.freed_after]
        if kind == BACKWARD:  # the gradient of the stage's input, sent back; anything else dies with the pass
            return self._held_for_send(action) if self._sent(row, stage) else self.span[action][-1]
        if self._freed_in_forward(row):  # by another stage's forward in the trace: here when the forward returns
            return self.span[action][-1]
        return backward[-1]

    def _later(self, action: Action, kind: str) -> Action | None:
        following = self.actions[self.actions.index(action) + 1 :]
        return next((a for a in following if a[0] == kind), None)

    def _passes_end(self) -> int:
        return min(self.optimizer_at.values()) - 1 if self.optimizer_at else max(i[-1] for i in self.span.values())

    def _held_by_output_variable(self, action: Action) -> int:
        """``ScheduleGPipe``'s and ``Schedule1F1B``'s ``output`` holds a forward's result until the next forward
        returns; the interleaved runtime's is local to the action."""
        if self.plan.schedule in LOOPED:
            return self.span[action][-1]
        following = self._later(action, FORWARD)
        return self.span[following][-1] if following else self._passes_end()

    def _held_for_send(self, action: Action) -> int:
        """GPipe rebinds its send ops when the next backward starts, 1F1B its ``bwd_sends`` when it is done; the
        interleaved runtime sends right after the backward and keeps only the send's work."""
        if self.plan.schedule in LOOPED:
            return self.span[action][-1]
        following = self._later(action, BACKWARD)
        if following is None:
            return self._passes_end()
        if self.plan.schedule == "gpipe":
            return self.span[following][0] - 1
        return self.span[following][-1]


MAX_ACTIVE_STAGES = 3  # _add_unshard_reshard's default: the stages a rank keeps unsharded (FSDP) at once


def unshard_reshard(stages: list[int]) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """What ``_PipelineScheduleRuntime`` adds for FSDP around each compute action of a rank that runs several
    stages (schedules.py ``_add_unshard_reshard``), given the stage of each action in order: before each, the
    stages it reshards (no longer among the next ``MAX_ACTIVE_STAGES`` distinct stages to run) and those it
    unshards (among them, not yet unsharded), in that order; and the stages resharded after the last action."""
    active: list[int] = []
    around = []
    for position in range(len(stages)):
        upcoming = list(dict.fromkeys(stages[position:]))[:MAX_ACTIVE_STAGES]
        evict = [stage for stage in active if stage not in upcoming]
        fetch = [stage for stage in upcoming if stage not in active]
        active = [stage for stage in active if stage in upcoming] + fetch
        around.append((evict, fetch))
    return around, active
