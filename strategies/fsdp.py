"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on every decoder layer and on the root model, for one rank.

Follows the runtime in torch/distributed/fsdp/_fully_shard (torch 2.11-2.13), with its defaults:

* Each parameter is sharded on dim 0, padded to a multiple of the world size (``FSDPParam``); optimizer
  states hold the rank's unpadded chunk.
* Forward, per unit: all-gather into one flat buffer (``foreach_all_gather``; with a mixed-precision policy
  the local shards are first copied into one flat buffer of the compute dtype), free the previous unit's
  flat buffer, copy out into per-parameter unsharded storages (``wait_for_unshard``: in forward the flat
  buffer is kept until the next unit's copy-out), run, free the unsharded storages (``reshard``). The root
  does not reshard after forward (``_lazy_init`` clears its ``post_forward_mesh_info``); its post-forward
  frees the last flat buffer the forward kept (``FSDPState._post_forward``).
* Backward, per unit: copy out the prefetched buffer and free it, prefetch the next unit in backward order
  (``_backward_prefetch``), run, then ``post_backward``: free the unsharded storages, free the
  reduce-scatter input held from the previous unit (``reduce_scatter_max_input_buffers`` = 1), copy the
  unsharded gradients into a flat reduce-scatter input and free them, and reduce-scatter into a flat
  sharded-gradient buffer, cast to the parameter dtype if the reduce dtype differs (``foreach_reduce``).
  The root reduce-scatters in the final backward callback, which then drops the held inputs.
* Sharded gradients live until ``zero_grad``.

With a mixed-precision policy the traced step is the one that computes in ``param_dtype`` (the unsharded
parameters, activations and gradients); sharded parameters, optimizer states and optimizer temporaries
keep the original dtype.

With expert parallelism the units, parameter groups and prefetching are torchtitan's instead
(:class:`_ExpertParallelFsdp`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from strategies.collectives import gradient_bytes, parameter_bytes, recorded, sharded_data_parallel
from strategies.pipeline import unshard_reshard
from strategies.rewrite import Point, Rewrite, unit_windows
from strategies.sharding import Dim0Shard
from tracer.errors import UserError
from tracer.expert_parallel import expert_weight
from tracer.graph import (
    ALL_GATHER,
    DATA_PARALLEL,
    DEVICE_TO_HOST,
    HOST_TO_DEVICE,
    REDUCE_SCATTER,
    Collective,
    PipelinePass,
    StepGraph,
    StorageRow,
    Transfer,
)
from tracer.modules import enclosing_block, within
from tracer.roles import Phase, Role
from tracer.trace import element_size
from tracer.training import TrainingSetup

ROOT = ""
# The first torch whose fully_shard shards a frozen integer parameter (LLM.int8()'s weights): before it,
# ``FSDPParam._init_sharded_param`` made every shard require a gradient, which an integer tensor refuses
# (pytorch#177844; fixed by pytorch#177948 in March 2026, after the 2.11 branch cut, before 2.12's).
INTEGER_PARAMETERS_TORCH = (2, 12)
FLOAT32_BYTES = element_size("float32")
# FSDP2's side streams, whose blocks the caching allocator pools apart from the compute stream's
# (_fsdp_collectives.py): foreach_all_gather allocates the parameters' all-gather inputs and the flat output under
# ``all_gather_copy_in_stream``; foreach_reduce allocates the reduce-scatter output, the sharded gradients, under
# ``reduce_scatter_stream``. The unsharded parameters and the reduce-scatter input come from the compute stream.
ALL_GATHER_STREAM = "FSDP all_gather_copy_in_stream"
REDUCE_SCATTER_STREAM = "FSDP reduce_scatter_stream"


@dataclass(frozen=True)
class FsdpPlan:
    world: int  # size of the sharding (data-parallel) group
    rank: int = 0
    reshard_after_forward: bool = True
    mixed_precision: bool = False  # MixedPrecisionPolicy(param_dtype=<traced dtype>, reduce_dtype=float32)
    offload: bool = False  # CPUOffloadPolicy: sharded parameters, gradients and the optimizer step on the host
    # > 1: torchtitan's layout with expert parallelism over groups of this many ranks (_ExpertParallelFsdp)
    expert_parallel: int = 1


@dataclass(frozen=True)
class Fsdp2:
    """The runtime of PyTorch's ``--zero 2`` and ``--zero 3``: ``fully_shard`` over ``world`` ranks, of the
    tensor-parallel slices when ``tensor_parallel`` > 1, as torchtitan lays it out when ``expert_parallel`` > 1."""

    world: int
    reshard_after_forward: bool = True
    offload: bool = False
    tensor_parallel: int = 1
    expert_parallel: int = 1  # > 1: torchtitan's FSDP2 with the experts split over groups of this many ranks

    @property
    def name(self) -> str:
        return "FSDP2" if self.reshard_after_forward else "FSDP2 (reshard_after_forward=False)"

    @property
    def note(self) -> str:
        if self.expert_parallel > 1:
            experts = self.world // self.expert_parallel
            policy = "default" if self.reshard_after_forward else "never"
            return (
                f"torchtitan's apply_fsdp (fsdp_reshard_after_forward={policy!r}): fully_shard on the token embedding, "
                f"each decoder layer, the final norm with the output layer (not resharded after forward) and the "
                f"root; a MoE layer's routed experts in a parameter group of their own, sharded over the {experts} "
                "GPU(s) holding the same experts, the rest over all; forward and backward prefetch set explicitly, "
                "one module ahead; the reduce-scatter inputs of a layer's two groups held until the next layer's"
            )
        return (
            f"fully_shard on each decoder layer and on the root, reshard_after_forward={self.reshard_after_forward}, "
            "one unit prefetched in backward, one reduce-scatter input held"
        )

    def traced_setup(self, setup: TrainingSetup) -> tuple[TrainingSetup, str | None]:
        """With mixed precision, the step that computes in the low-precision dtype: FSDP2's
        ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`` keeps fp32 shards, not autocast."""
        if not setup.mixed_precision:
            return setup, None
        low = setup.mixed_precision
        note = f"FSDP2 MixedPrecisionPolicy(param_dtype={low}, reduce_dtype=float32) instead of autocast"
        if setup.dtype != "fp32":
            note = f"{setup.dtype} weights: FSDP2 shards, gathers and updates them in {setup.dtype}, without autocast"
        lora = setup.lora and dataclasses.replace(setup.lora, float32_adapters=False)  # adapters compute in low
        return dataclasses.replace(setup, dtype=low, mixed_precision=None, lora=lora), note

    def distinct_ranks(self, step: StepGraph) -> list[int]:
        """Rank 0, and the last rank when a dimension does not split evenly (its shards are padded)."""
        if self.expert_parallel > 1:
            placements = _expert_parallel_placements(step, self.world, self.expert_parallel).values()
            uneven = any(placement.shard.rows % placement.shard.world for placement in placements)
        else:
            shapes = [row.shape for row in step.storages.values() if row.role is Role.PARAMETER]
            uneven = any(shape and shape[0] % (self.tensor_parallel * self.world) for shape in shapes)
        return [0, self.world - 1] if uneven else [0]

    def apply(self, step: StepGraph, setup: TrainingSetup, rank: int) -> StepGraph:
        mixed = setup.mixed_precision is not None and setup.dtype == "fp32"  # fp32 shards, low-precision compute
        plan = FsdpPlan(self.world, rank, self.reshard_after_forward, mixed, self.offload, self.expert_parallel)
        reduce_bytes = FLOAT32_BYTES if mixed else None  # MixedPrecisionPolicy(reduce_dtype=float32)
        if self.expert_parallel > 1:
            runtime = _ExpertParallelFsdp(step, plan)
            return recorded(runtime.build(), *runtime.collectives(reduce_bytes))
        return recorded(fsdp(step, plan), *sharded_data_parallel(step, self.reshard_after_forward, reduce_bytes))


def fsdp(step: StepGraph, plan: FsdpPlan) -> StepGraph:
    """The step of rank ``plan.rank`` under FSDP2."""
    if plan.world < 2:
        raise ValueError("FSDP needs a data-parallel group of at least 2 ranks")
    if plan.expert_parallel > 1:
        return _ExpertParallelFsdp(step, plan).build()
    return _Fsdp(step, plan).build()


class _Fsdp:
    def __init__(self, step: StepGraph, plan: FsdpPlan) -> None:
        self.step, self.plan = step, plan
        self.rw = Rewrite(step)
        self.params = {row.param: row for row in step.storages.values() if row.role is Role.PARAMETER and row.param}
        self.blocks = set(step.structure.blocks)
        self.units: dict[str, list[str]] = {block: [] for block in step.structure.blocks} | {ROOT: []}
        for name in self.params:
            self.units[self._unit_of(name)].append(name)
        self.paths = {unit: (unit,) for unit in step.structure.blocks} | {ROOT: ("",)}
        self.shards = {name: Dim0Shard(row.shape, plan.world) for name, row in self.params.items()}
        self.compute = {name: element_size(row.dtype) for name, row in self.params.items()}
        self.grads: dict[str, list[StorageRow]] = defaultdict(list)
        for row in step.storages.values():
            if row.role is Role.GRADIENT and row.param in self.params:
                self.grads[self._unit_of(row.param)].append(row)
        self.trained = {row.param for rows in self.grads.values() for row in rows}
        # Later micro-steps' gradients, by unit: autograd sets the unsharded parameter's .grad afresh (the
        # previous one was reduce-scattered), which the trace shows as the tensor added into the gradient.
        self.accumulated: dict[str, list[StorageRow]] = defaultdict(list)
        for row in step.storages.values():
            if row.role is not Role.GRADIENT and row.param in self.trained and step.made_in(row, Phase.BACKWARD):
                self.accumulated[self._unit_of(row.param)].append(row)
        self.unsharded: dict[str, list[int]] = defaultdict(list)  # unsharded storages not freed yet
        self.held_reduce_input: int | None = None
        self.float32_grads: dict[str, list[int]] = {}  # a pipeline stage's accumulated gradients, by unit

    def shard_rank(self, name: str) -> int:
        """This rank's place in the group that shards parameter ``name``."""
        return self.plan.rank

    def master(self, name: str) -> int:
        """Bytes per element of the sharded parameter and its optimizer state."""
        return FLOAT32_BYTES if self.plan.mixed_precision else self.compute[name]

    def reduce(self, name: str) -> int:
        return FLOAT32_BYTES if self.plan.mixed_precision else self.compute[name]

    def master_dtype(self, names: list[str]) -> str:
        """The dtype of shards, their optimizer states and reduced gradients (one per unit: its first)."""
        return "float32" if self.plan.mixed_precision or not names else self.params[names[0]].dtype

    def compute_dtype(self, names: list[str]) -> str:
        return self.params[names[0]].dtype if names else ""

    def build(self) -> StepGraph:
        self.shard_state()
        pipeline_passes = self.step.pipeline_passes()
        if pipeline_passes:
            self.pipelined(pipeline_passes)
            return self.rw.build()
        for passes in self.step.micro_steps():
            windows = unit_windows(self.step, self.paths, passes)
            self.forward(windows)
            self.backward(windows, passes)
        return self.rw.build()

    def shard_state(self) -> None:
        """Parameters keep a padded shard; optimizer states and temporaries the rank's chunk."""
        for row in self.step.storages.values():
            if row.param not in self.shards:
                continue
            shard, name = self.shards[row.param], row.param
            if row.role is Role.PARAMETER:
                self.rw.resize(row.id, shard.padded_shard_numel * self.master(name), self.master_dtype([name]))
            elif row.role is Role.OPTIMIZER_STATE or self.step.made_in(row, Phase.OPTIMIZER):
                numel = self.params[name].numel
                if row.numel > 1 and row.nbytes % numel == 0:
                    element = row.nbytes // numel * self.master(name) // self.compute[name]
                    dtype = self.master_dtype([name]) if row.dtype == self.params[name].dtype else None
                    self.rw.resize(row.id, shard.local_numel(self.shard_rank(name)) * element, dtype)
            else:
                continue
            if self.plan.offload:
                self.rw.to_host(row.id)

    def forward(self, windows: dict[str, dict[Phase, tuple[int, int]]]) -> None:
        held = None
        for unit in (ROOT, *self.step.structure.blocks):
            first, last = windows[unit][Phase.FORWARD]
            gather = self.all_gather(unit, self.rw.before(first, "fsdp.all_gather", unit, Phase.FORWARD))
            if held is not None:
                self.rw.retime(held, last=gather.point)
            held = gather.buffer
            copy_out = self.rw.before(first, "fsdp.all_gather_copy_out", unit, Phase.FORWARD)
            reshards = unit != ROOT and self.plan.reshard_after_forward
            end = self.rw.after(last, "fsdp.reshard", unit, Phase.FORWARD) if reshards else None
            rows = self.copy_out(unit, copy_out, end)
            if not reshards:
                self.unsharded[unit] = rows
        root_end = windows[ROOT][Phase.FORWARD][1]
        self.rw.retime(held, last=self.rw.after(root_end, "fsdp.root_post_forward", ROOT, Phase.FORWARD))

    def backward(self, windows: dict[str, dict[Phase, tuple[int, int]]], passes: range) -> None:
        """Units that were resharded after forward all-gather again, each prefetching the next; without
        resharding, the parameters are still unsharded and nothing is gathered. ``passes``: the micro-step's
        ops."""
        order = [ROOT, *reversed(self.step.structure.blocks)]
        prefetched: dict[str, int] = {}
        for position, unit in enumerate(order):
            first, last = windows[unit][Phase.BACKWARD]
            if unit != ROOT and self.plan.reshard_after_forward:
                copy_out = self.rw.before(first, "fsdp.all_gather_copy_out", unit, Phase.BACKWARD)
                self.rw.retime(prefetched.pop(unit), last=copy_out)
                self.unsharded[unit] = self.copy_out(unit, copy_out, None)
            if position + 1 < len(order) and self.plan.reshard_after_forward:
                following = order[position + 1]
                point = self.rw.before(first, "fsdp.all_gather (prefetch)", following, Phase.BACKWARD)
                prefetched[following] = self.all_gather(following, point).buffer
            if unit != ROOT:
                self.post_backward(unit, last, passes)
        # The root's post_backward runs in the final callback, which then drops the held reduce-scatter input.
        end = max(window[Phase.BACKWARD][1] for window in windows.values())
        self.post_backward(ROOT, end, passes)
        if self.held_reduce_input is not None:
            finalize = self.rw.after(end, "fsdp.finalize_backward", ROOT, Phase.BACKWARD)
            self.rw.retime(self.held_reduce_input, last=finalize)
            # Every micro-step's backward ends there (is_last_backward defaults to True): no held input crosses
            # into the next micro-step (FSDPState._root_post_backward_final_callback).
            self.held_reduce_input = None

    def pipelined(self, passes: list[PipelinePass]) -> None:
        """A pipeline rank's step (torch.distributed.pipelining, stage.py ``backward_maybe_with_nosync``): every
        microbatch's backward runs with ``set_requires_gradient_sync(False)`` and
        ``set_reshard_after_backward(False)``, so the unsharded parameters stay gathered from their first backward
        on and the unsharded gradients accumulate (in float32 under a mixed-precision policy:
        ``to_accumulated_grad_if_needed``); after the last backward, ``perform_reduce_grad`` runs every
        unit's ``post_backward`` with reduction, in the stage's module order (root first). A rank running several
        stages runs them as :meth:`looped` says."""
        stages = list(dict.fromkeys(stage_pass.stage for stage_pass in passes))
        if len(stages) > 1:
            self.looped(passes, stages)
            return
        units = (ROOT, *self.step.structure.blocks)
        for stage_pass in passes:
            windows = unit_windows(self.step, self.paths, stage_pass.ops)
            if stage_pass.phase is Phase.FORWARD:
                self.pipelined_forward(windows, units)
            else:
                self.pipelined_backward(windows, stage_pass.ops, units)
        self.reduce_stage(units, max(stage_pass.ops[-1] for stage_pass in passes))

    def looped(self, passes: list[PipelinePass], stages: list[int]) -> None:
        """Several stages on one rank, each its own FSDP root (torchtitan shards each model part), under
        ``_PipelineScheduleRuntime``, whose lowering adds around the compute actions (``_add_unshard_reshard``,
        ``_add_reduce_grad``): UNSHARD, each unit of a stage about to run all-gathering asynchronously, copied
        out (its flat buffer freed) when the stage next computes (``_assert_unsharded``); RESHARD, a stage no
        longer among the next few freeing its unsharded parameters; REDUCE_GRAD, a stage's ``perform_reduce_grad``
        right after its last backward."""
        units = self.stage_units(passes, stages)
        around, resharded_at_end = unshard_reshard([stage_pass.stage for stage_pass in passes])
        backwards_left = defaultdict(int)
        for stage_pass in passes:
            backwards_left[stage_pass.stage] += stage_pass.phase is Phase.BACKWARD
        pending: dict[str, int] = {}  # units gathered by an UNSHARD, not copied out yet: their flat buffers
        for stage_pass, (evict, fetch) in zip(passes, around, strict=True):
            start, phase = stage_pass.ops[0], stage_pass.phase
            for stage in evict:
                self.reshard_units(units[stage], start, phase)
            for stage in fetch:
                for unit in units[stage]:
                    if unit not in self.unsharded and unit not in pending:
                        point = self.rw.before(start, "fsdp.all_gather (unshard)", unit, phase)
                        pending[unit] = self.all_gather(unit, point).buffer
            for unit in units[stage_pass.stage]:
                if unit in pending:
                    copy_out = self.rw.before(start, "fsdp.all_gather_copy_out", unit, phase)
                    self.rw.retime(pending.pop(unit), last=copy_out)
                    self.unsharded[unit] = self.copy_out(unit, copy_out, None)
            windows = unit_windows(self.step, self.paths, stage_pass.ops)
            if phase is Phase.FORWARD:
                self.pipelined_forward(windows, units[stage_pass.stage])
                continue
            self.pipelined_backward(windows, stage_pass.ops, units[stage_pass.stage])
            backwards_left[stage_pass.stage] -= 1
            if not backwards_left[stage_pass.stage]:
                self.reduce_stage(units[stage_pass.stage], stage_pass.ops[-1])
        end = passes[-1].ops[-1]
        for stage in resharded_at_end:
            self.reshard_units(units[stage], end + 1, Phase.BACKWARD)

    def stage_units(self, passes: list[PipelinePass], stages: list[int]) -> dict[int, tuple[str, ...]]:
        """Each stage's FSDP units: its decoder layers, after its root if the rank's root parameters are its (the
        embedding on the first stage, the final norm and output layer on the last)."""
        root_params = {self.params[name].id for name in self.units[ROOT]}
        units: dict[int, list[str]] = {stage: [] for stage in stages}
        for stage_pass in passes:
            ops = self.step.ops[stage_pass.ops.start : stage_pass.ops.stop]
            if ROOT not in units[stage_pass.stage] and any(root_params.intersection(op.inputs) for op in ops):
                units[stage_pass.stage].insert(0, ROOT)
            for unit in unit_windows(self.step, self.paths, stage_pass.ops):
                if unit != ROOT and unit not in units[stage_pass.stage]:
                    units[stage_pass.stage].append(unit)
        order = {unit: position for position, unit in enumerate((ROOT, *self.step.structure.blocks))}
        return {stage: tuple(sorted(found, key=order.__getitem__)) for stage, found in units.items()}

    def reshard_units(self, units: tuple[str, ...], before: int, phase: Phase) -> None:
        """RESHARD: free the units' unsharded parameters."""
        for unit in units:
            if unit in self.unsharded:
                reshard = self.rw.before(before, "fsdp.reshard", unit, phase)
                for storage_id in self.unsharded.pop(unit):
                    self.rw.retime(storage_id, last=reshard)

    def reduce_stage(self, units: tuple[str, ...], end: int) -> None:
        """``perform_reduce_grad``: each unit's post-backward with reduction, then the final callback, which drops
        the held reduce-scatter input."""
        for unit in units:
            self.reduce_accumulated(unit, end)
        finalize = self.rw.after(end, "fsdp.finalize_backward", ROOT, Phase.BACKWARD)
        if self.held_reduce_input is not None:
            self.rw.retime(self.held_reduce_input, last=finalize)
            self.held_reduce_input = None

    def pipelined_forward(self, windows: dict[str, dict[Phase, tuple[int, int]]], units: tuple[str, ...]) -> None:
        """Each of the stage's ``units`` gathers unless it is still unsharded; the non-root units reshard after
        forward when ``reshard_after_forward``. The last flat buffer gathered is freed by the root's post-forward,
        which runs when the stage's module returns (before the schedule computes the loss on the last stage)."""
        held = None
        for unit in units:
            if Phase.FORWARD not in windows.get(unit, {}):
                continue
            first, last = windows[unit][Phase.FORWARD]
            if unit not in self.unsharded:
                gather = self.all_gather(unit, self.rw.before(first, "fsdp.all_gather", unit, Phase.FORWARD))
                if held is not None:
                    self.rw.retime(held, last=gather.point)
                held = gather.buffer
                copy_out = self.rw.before(first, "fsdp.all_gather_copy_out", unit, Phase.FORWARD)
                self.unsharded[unit] = self.copy_out(unit, copy_out, None)
            if unit != ROOT and self.plan.reshard_after_forward:
                reshard = self.rw.after(last, "fsdp.reshard", unit, Phase.FORWARD)
                for storage_id in self.unsharded.pop(unit):
                    self.rw.retime(storage_id, last=reshard)
        if held is not None:
            end = self._module_forward_end(windows)
            self.rw.retime(held, last=self.rw.after(end, "fsdp.root_post_forward", ROOT, Phase.FORWARD))

    def _module_forward_end(self, windows: dict[str, dict[Phase, tuple[int, int]]]) -> int:
        """The last op the stage's module runs in a forward: the output layer's on the last stage, whose loss the
        schedule computes after the module has returned; else the pass's last."""
        last = max(spans[Phase.FORWARD][1] for spans in windows.values() if Phase.FORWARD in spans)
        output = self.step.structure.output_embedding
        if output and Phase.FORWARD in windows.get(ROOT, {}):
            first, root_last = windows[ROOT][Phase.FORWARD]
            outputs = (i for i in range(first, root_last + 1) if within(self.step.ops[i].module, output))
            return max(outputs, default=last)
        return last

    def pipelined_backward(
        self, windows: dict[str, dict[Phase, tuple[int, int]]], ops: range, units: tuple[str, ...]
    ) -> None:
        """Units resharded after forward gather again, each prefetching the next in backward order that is
        sharded; none reshards or reduces. Under a mixed-precision policy each unit's post-backward moves the
        low-precision gradient autograd made into the float32 accumulated one (made at the step's first
        backward, added into at later ones)."""
        order = [unit for unit in (ROOT, *reversed(units)) if unit in units and Phase.BACKWARD in windows.get(unit, {})]
        order = list(dict.fromkeys(order))
        end = max(windows[unit][Phase.BACKWARD][1] for unit in order)  # the root's post-backward runs last
        prefetched: dict[str, int] = {}
        for position, unit in enumerate(order):
            first, last = windows[unit][Phase.BACKWARD]
            if unit not in self.unsharded:
                copy_out = self.rw.before(first, "fsdp.all_gather_copy_out", unit, Phase.BACKWARD)
                buffer = prefetched.pop(unit, None)
                if buffer is None:
                    buffer = self.all_gather(unit, copy_out).buffer
                self.rw.retime(buffer, last=copy_out)
                self.unsharded[unit] = self.copy_out(unit, copy_out, None)
            following = order[position + 1] if position + 1 < len(order) else None
            if following is not None and following not in self.unsharded:
                point = self.rw.before(first, "fsdp.all_gather (prefetch)", following, Phase.BACKWARD)
                prefetched[following] = self.all_gather(following, point).buffer
            if self.plan.mixed_precision:
                self.accumulate_in_float32(unit, end if unit == ROOT else last, ops)

    def accumulate_in_float32(self, unit: str, last: int, ops: range) -> None:
        """The float32 copy is the gradient's size, which is the parameter's but for a vocabulary-parallel
        embedding's (DTensor computes it at full size)."""
        post_backward = self.rw.after(last, "fsdp.post_backward (accumulate)", unit, Phase.BACKWARD)
        if unit not in self.float32_grads:
            made = [row for row in self.grads[unit] if row.producer in ops]
            for row in made:
                self.rw.retime(row.id, last=post_backward)
            self.float32_grads[unit] = [
                self.rw.add(
                    row.nbytes // element_size(row.dtype) * FLOAT32_BYTES,
                    Role.GRADIENT,
                    post_backward,
                    None,
                    f"{row.param} (unsharded accumulated gradient)",
                    "float32",
                    row.param,
                )
                for row in made
            ]
            return
        for row in self.accumulated[unit]:
            if row.producer in ops:
                self.rw.retime(row.id, last=post_backward)

    def reduce_accumulated(self, unit: str, end: int) -> None:
        """``post_backward`` with reduction (``perform_reduce_grad``): free the unsharded parameters, copy the
        accumulated gradients into a flat reduce-scatter input (the previous unit's is freed), free them, and
        reduce-scatter into the sharded gradients that live until ``zero_grad``."""
        rw = self.rw
        reshard = rw.after(end, "fsdp.reshard", unit, Phase.BACKWARD)
        for storage_id in self.unsharded.pop(unit, []):
            rw.retime(storage_id, last=reshard)
        names = [name for name in self.units[unit] if name in self.trained]
        if not names:
            return
        if self.held_reduce_input is not None:
            rw.retime(self.held_reduce_input, last=reshard)
        reduce_in = rw.after(end, "fsdp.reduce_scatter", unit, Phase.BACKWARD)
        size = sum(self.shards[n].padded_numel * self.reduce(n) for n in names)
        reduce_dtype = self.master_dtype(names)
        self.held_reduce_input = rw.add(
            size, Role.COMMUNICATION, reduce_in, None, f"reduce-scatter {unit or 'root'}", reduce_dtype
        )
        accumulated = self.float32_grads.pop(unit, None)
        for storage_id in accumulated if accumulated is not None else [row.id for row in self.grads[unit]]:
            rw.retime(storage_id, last=reduce_in)
        zero_grad = max((row.freed_after for row in self.grads[unit] if row.freed_after is not None), default=None)
        reduce_out = rw.after(end, "fsdp.reduce_scatter_output", unit, Phase.BACKWARD)
        sharded_bytes = sum(self.shards[n].padded_shard_numel * self.reduce(n) for n in names)
        name = f"sharded gradients {unit or 'root'}"
        kept_until = None if zero_grad is None else Point(zero_grad, 0)
        rw.add(sharded_bytes, Role.GRADIENT, reduce_out, kept_until, name, reduce_dtype, stream=REDUCE_SCATTER_STREAM)

    def all_gather(self, unit: str, point: Point) -> _Gather:
        names = self.units[unit]
        if self.plan.offload:  # each shard is copied to the device first (FSDPParam.all_gather_inputs)
            copied = sum(self.shards[n].padded_shard_numel * self.master(n) for n in names)
            name = f"shards from host {unit or 'root'}"
            self.rw.add(
                copied, Role.COMMUNICATION, point, point, name, self.master_dtype(names), stream=ALL_GATHER_STREAM
            )
            phase = self.step.ops[point.original].phase
            what = f"parameter shards of {unit or 'the root'}"
            self.rw.transfers.append(Transfer(phase, HOST_TO_DEVICE, copied, what, f"{phase.value} (prefetch)"))
        if self.plan.mixed_precision:  # local shards copied into one flat buffer of the compute dtype
            copy_in = sum(self.shards[n].padded_shard_numel * self.compute[n] for n in names)
            name = f"all-gather input {unit or 'root'}"
            dtype = self.compute_dtype(names)
            self.rw.add(copy_in, Role.COMMUNICATION, point, point, name, dtype, stream=ALL_GATHER_STREAM)
        size = sum(self.shards[n].padded_numel * self.compute[n] for n in names)
        name = f"all-gather {unit or 'root'}"
        buffer = self.rw.add(
            size, Role.COMMUNICATION, point, None, name, self.compute_dtype(names), stream=ALL_GATHER_STREAM
        )
        return _Gather(point, buffer)

    def copy_out(self, unit: str, first: Point, last: Point | None) -> list[int]:
        return [
            self.rw.add(
                self.shards[name].padded_numel * self.compute[name],
                Role.PARAMETER,
                first,
                last,
                f"{name} (unsharded)",
                self.params[name].dtype,
                name,
            )
            for name in self.units[unit]
        ]

    def post_backward(self, unit: str, last: int, passes: range) -> None:
        rw, names = self.rw, self.units[unit]
        reshard = rw.after(last, "fsdp.reshard", unit, Phase.BACKWARD)
        for storage_id in self.unsharded.pop(unit, []):
            rw.retime(storage_id, last=reshard)
        if self.held_reduce_input is not None:
            rw.retime(self.held_reduce_input, last=reshard)
        self.held_reduce_input = None
        names = [name for name in names if name in self.trained]
        if not names:  # frozen parameters have no gradient: nothing is reduced (FSDPParamGroup.post_backward)
            return
        reduce_in = rw.after(last, "fsdp.reduce_scatter", unit, Phase.BACKWARD)
        size = sum(self.shards[n].padded_numel * self.reduce(n) for n in names)
        reduce_dtype = self.master_dtype(names)
        self.held_reduce_input = rw.add(
            size, Role.COMMUNICATION, reduce_in, None, f"reduce-scatter {unit or 'root'}", reduce_dtype
        )
        reduce_out = rw.after(last, "fsdp.reduce_scatter_output", unit, Phase.BACKWARD)
        sharded_bytes = sum(self.shards[n].padded_shard_numel * self.reduce(n) for n in names)
        if passes.start > 0:  # a later micro-step: the reduced gradients are added into the sharded ones
            for row in self.accumulated[unit]:
                if row.producer in passes:
                    rw.retime(row.id, last=reduce_in)
            name = f"reduce-scatter output {unit or 'root'}"
            rw.add(
                sharded_bytes, Role.GRADIENT, reduce_out, reduce_out, name, reduce_dtype, stream=REDUCE_SCATTER_STREAM
            )
            if self.plan.offload:
                what = f"sharded gradients of {unit or 'the root'}"
                rw.transfers.append(Transfer(Phase.BACKWARD, DEVICE_TO_HOST, sharded_bytes, what, ""))
            return
        zero_grad = max((row.freed_after for row in self.grads[unit] if row.freed_after is not None), default=None)
        for row in self.grads[unit]:
            rw.retime(row.id, last=reduce_in)
        kept_until = None if zero_grad is None else Point(zero_grad, 0)
        name = f"sharded gradients {unit or 'root'}"
        sharded = rw.add(
            sharded_bytes, Role.GRADIENT, reduce_out, kept_until, name, reduce_dtype, stream=REDUCE_SCATTER_STREAM
        )
        if self.plan.offload:  # copied to the host as soon as reduced (foreach_reduce), freed on the device
            to_host = rw.after(last, "fsdp.gradients_to_host", unit, Phase.BACKWARD)
            rw.retime(sharded, last=to_host)
            sizes = sum(self.shards[n].padded_shard_numel * self.master(n) for n in names)
            name = f"sharded gradients {unit or 'root'} (host)"
            rw.add(sizes, Role.GRADIENT, to_host, kept_until, name, reduce_dtype, on_device=False)
            what = f"sharded gradients of {unit or 'the root'}"
            rw.transfers.append(Transfer(Phase.BACKWARD, DEVICE_TO_HOST, sharded_bytes, what, "backward"))
            return

    def _unit_of(self, param: str) -> str:
        return enclosing_block(param, self.blocks) or ROOT


@dataclass(frozen=True)
class _Gather:
    point: Point
    buffer: int


@dataclass(frozen=True)
class _Placement:
    """How torchtitan's layout shards one parameter: ``shard`` has the sizes of ``Shard(dim)`` (those of
    ``Shard(0)`` on the shape with ``dim`` moved first), over all the ranks or, for a routed expert's weight,
    over the ranks that hold the same experts."""

    shard: Dim0Shard
    dim: int
    experts: bool


def _expert_parallel_placements(step: StepGraph, world: int, expert_parallel: int) -> dict[str, _Placement]:
    """Each parameter's placement under torchtitan's ``apply_fsdp`` with expert parallelism: the dense ones
    ``Shard(0)`` over all ``world`` ranks; a MoE layer's routed experts (this rank's ``1 / expert_parallel`` of
    them, by the model's ``ep_plan``) over the ``world / expert_parallel`` ranks holding the same experts, on
    dim 0, or on dim 1 where those ranks outnumber the local experts (torchtitan: efsdp x ep > experts), which
    FSDP2 shards only evenly."""
    experts_world = world // expert_parallel
    placements = {}
    for row in step.storages.values():
        if row.role is not Role.PARAMETER or not row.param:
            continue
        if not expert_weight(step.structure.ep_plan, row.param):
            placements[row.param] = _Placement(Dim0Shard(row.shape, world), 0, False)
        elif experts_world > row.shape[0]:
            if row.shape[1] % experts_world:
                raise UserError(
                    f"--ep {expert_parallel} over --gpus {world}: the {experts_world} GPUs holding the same experts "
                    f"outnumber the {row.shape[0]} each holds, so torchtitan shards them on dim 1, which FSDP2 splits "
                    f"only evenly, and {row.param} has {row.shape[1]} there: use --gpus at most the model's "
                    f"{row.shape[0] * expert_parallel} experts, or a --gpus / --ep dividing {row.shape[1]}."
                )
            shape = (row.shape[1], row.shape[0], *row.shape[2:])
            placements[row.param] = _Placement(Dim0Shard(shape, experts_world), 1, True)
        else:
            placements[row.param] = _Placement(Dim0Shard(row.shape, experts_world), 0, True)
    return placements


class _ExpertParallelFsdp(_Fsdp):
    """FSDP2 as torchtitan's ``apply_fsdp`` lays it out with expert parallelism (torchtitan/distributed/fsdp.py and
    experiments/transformers_modeling_backend/parallelize.py at commit 73aed7f6), run by torch 2.13's
    ``_fully_shard``:

    * Units: the token embedding, each decoder layer, the final norm with the output layer (``fully_shard([norm,
      lm_head])``, never resharded after forward under the ``default`` and ``never`` policies) and the root, which
      holds no parameters. A MoE layer's ``shard_placement_fn`` puts its routed experts in a second parameter group
      (``FSDPParamGroup``) on the mesh of the ranks holding the same experts; the dense group comes first, as its
      parameters do.
    * Prefetching is explicit (``set_modules_to_forward_prefetch`` and ``..._backward_prefetch``, one unit ahead):
      in forward each unit, after its copy-out, all-gathers the next unit's groups, which hold their buffers until
      that unit's copy-out; the groups share one comm context, whose ``all_gather_state`` keeps the last copied-out
      buffer of any group until the next group's ``wait_for_unshard``. In backward each unit's pre-backward copies
      out its groups (each buffer freed after its copy-out) and then all-gathers the previous unit's groups, last
      group first.
    * A group of one rank (the experts, where ``--ep`` equals ``--gpus``) allocates no all-gather buffer: its
      ``wait_for_unshard`` copies each shard (cast to the compute dtype under a mixed-precision policy, the cast
      freed when the next is made) into the unsharded storage; it still frees the comm context's held buffer in
      forward and keeps none. Its ``foreach_reduce`` copies the reduce-scatter input into the output through a
      temporary (``input / gradient_divide_factor``: torchtitan sets the factor to 1).
    * ``Shard(1)``: the copy-out goes through a temporary per parameter (``foreach_all_gather_copy_out``) and the
      reduce-scatter input is built from each gradient's chunks concatenated on dim 0 (``foreach_reduce``).
    * Post-backward runs per group, the expert group first (autograd reaches its hook first); the last group
      waits on and frees every held reduce-scatter input (``reduce_scatter_max_input_buffers`` = 1) before
      reducing, so a layer's two inputs are held together until the next layer's; the embedding's runs in the
      final callback, which then frees what is held.
    """

    def __init__(self, step: StepGraph, plan: FsdpPlan) -> None:
        super().__init__(step, plan)
        self.placements = _expert_parallel_placements(step, plan.world, plan.expert_parallel)
        self.shards = {name: placement.shard for name, placement in self.placements.items()}
        structure = step.structure
        if not structure.output_embedding:
            raise UserError("--ep with --zero 2/3 needs the model's output layer: torchtitan shards it with the norm.")
        self.embedding, self.head = structure.input_embedding, structure.output_embedding
        outside = sorted({name.rpartition(".")[0] for name in self.params if self._outside(name)})
        if len(outside) > 1:
            raise UserError(
                "--ep with --zero 2/3 follows torchtitan's FSDP2 units (the token embedding, the decoder layers, the "
                f"final norm with the output layer); this model has parameters in {', '.join(outside)}, outside "
                "them, which is not modelled."
            )
        self.paths = (
            {self.embedding: (self.embedding,)}
            | {block: (block,) for block in structure.blocks}
            | {self.head: (*outside, self.head), ROOT: ("",)}
        )
        self.order = (self.embedding, *structure.blocks, self.head)  # the units, in forward order
        self.groups: dict[str, list[str]] = defaultdict(list)  # unit -> its groups' keys, in order
        self.units = defaultdict(list)  # group key -> its parameters
        for name in self.params:  # in registration order, which orders the groups
            unit = self._unit(name)
            key = f"{unit} experts" if self.placements[name].experts else unit
            if key not in self.groups[unit]:
                self.groups[unit].append(key)
            self.units[key].append(name)
        self.key_of = {name: key for key, names in self.units.items() for name in names}
        self.grads = defaultdict(list)
        for row in step.storages.values():
            if row.role is Role.GRADIENT and row.param in self.params:
                self.grads[self.key_of[row.param]].append(row)
        self.held_reduce_inputs: list[int] = []  # the comm context's reduce_scatter_states

    def collectives(self, reduce_bytes: int | None) -> list[Collective]:
        """What the layout gathers and reduces per step, each unit's dense group over all the GPUs and its experts'
        group over the GPUs holding the same experts (recorded apart, for that smaller group; nothing where it is
        one GPU); the final norm and output layer are gathered in forward only. ``reduce_bytes``: the element size
        of the reduction, None for the gradients' own."""
        experts_world = self.plan.world // self.plan.expert_parallel
        dense = [name for name in self.params if not self.placements[name].experts]
        groups = [(dense, "dense parameters")]
        if experts_world > 1:
            experts = [name for name in self.params if self.placements[name].experts]
            groups.append((experts, f"routed experts (over the {experts_world} GPUs holding them)"))
        records = []
        for names, what in groups:
            gathered = parameter_bytes(self.step, names)
            records.append(
                Collective(ALL_GATHER, DATA_PARALLEL, gathered, Phase.FORWARD, True, True, f"{what} before forward")
            )
            if self.plan.reshard_after_forward:
                again = parameter_bytes(self.step, set(names) - set(self.units[self.head]))
                records.append(
                    Collective(ALL_GATHER, DATA_PARALLEL, again, Phase.BACKWARD, True, True, f"{what} before backward")
                )
            reduced = gradient_bytes(self.step, reduce_bytes, names)
            what = f"gradients of the {what} after backward"
            records.append(Collective(REDUCE_SCATTER, DATA_PARALLEL, reduced, Phase.BACKWARD, True, True, what))
        return records

    def _outside(self, name: str) -> bool:
        """Whether parameter ``name`` lies outside the embedding, the decoder layers and the output layer (the
        final norm's)."""
        return not (enclosing_block(name, self.blocks) or within(name, self.embedding) or within(name, self.head))

    def _unit(self, name: str) -> str:
        if within(name, self.embedding):
            return self.embedding
        return enclosing_block(name, self.blocks) or self.head

    def shard_rank(self, name: str) -> int:
        """Rank r sits at (r // ep, r % ep) of torchtitan's (efsdp, ep) mesh: r // ep is its place among the ranks
        holding its experts."""
        return self.plan.rank // self.plan.expert_parallel if self.placements[name].experts else self.plan.rank

    def world_of(self, key: str) -> int:
        return self.shards[self.units[key][0]].world

    def forward(self, windows: dict[str, dict[Phase, tuple[int, int]]]) -> None:
        rw, held = self.rw, None
        prefetched: dict[str, int] = {}
        for position, unit in enumerate(self.order):
            first, last = windows[unit][Phase.FORWARD]
            reshards = self.plan.reshard_after_forward and unit != self.head
            end = rw.after(last, "fsdp.reshard", unit, Phase.FORWARD) if reshards else None
            for key in self.groups[unit]:
                buffer = prefetched.pop(key, None)
                if buffer is None and self.world_of(key) > 1:
                    buffer = self.all_gather(key, rw.before(first, "fsdp.all_gather", unit, Phase.FORWARD)).buffer
                wait = rw.before(first, "fsdp.wait_for_unshard", unit, Phase.FORWARD)
                if held is not None:
                    rw.retime(held, last=wait)
                held = buffer
                rows = self.copy_out_group(key, unit, first, Phase.FORWARD, end)
                if not reshards:
                    self.unsharded[key] = rows
            if position + 1 < len(self.order):
                following = self.order[position + 1]
                for key in self.groups[following]:
                    if self.world_of(key) > 1:
                        point = rw.before(first, "fsdp.all_gather (prefetch)", following, Phase.FORWARD)
                        prefetched[key] = self.all_gather(key, point).buffer
        root_end = windows[ROOT][Phase.FORWARD][1]
        if held is not None:
            rw.retime(held, last=rw.after(root_end, "fsdp.root_post_forward", ROOT, Phase.FORWARD))

    def backward(self, windows: dict[str, dict[Phase, tuple[int, int]]], passes: range) -> None:
        rw = self.rw
        order = [self.head, *reversed(self.step.structure.blocks), self.embedding]
        end = max(window[Phase.BACKWARD][1] for window in windows.values() if Phase.BACKWARD in window)
        prefetched: dict[str, int] = {}
        for position, unit in enumerate(order):
            first, last = windows[unit][Phase.BACKWARD]
            for key in self.groups[unit]:
                if key in self.unsharded:
                    continue
                buffer = prefetched.pop(key, None)
                if buffer is None and self.world_of(key) > 1:
                    buffer = self.all_gather(key, rw.before(first, "fsdp.all_gather", unit, Phase.BACKWARD)).buffer
                rows = self.copy_out_group(key, unit, first, Phase.BACKWARD, None)
                if buffer is not None:
                    rw.retime(buffer, last=rw.lifetime(rows[-1])[0])
                self.unsharded[key] = rows
            if position + 1 < len(order):
                previous = order[position + 1]
                for key in reversed(self.groups[previous]):
                    if key not in self.unsharded and self.world_of(key) > 1:
                        point = rw.before(first, "fsdp.all_gather (prefetch)", previous, Phase.BACKWARD)
                        prefetched[key] = self.all_gather(key, point).buffer
            # The embedding's input needs no gradient: its post-backward runs in the final callback.
            point = end if unit == self.embedding else last
            for key in reversed(self.groups[unit]):
                self.group_post_backward(key, unit, point, waits=key == self.groups[unit][-1])
        finalize = rw.after(end, "fsdp.finalize_backward", ROOT, Phase.BACKWARD)
        for storage_id in self.held_reduce_inputs:
            rw.retime(storage_id, last=finalize)
        self.held_reduce_inputs = []

    def copy_out_group(self, key: str, unit: str, first: int, phase: Phase, last: Point | None) -> list[int]:
        """``wait_for_unshard``'s copy into the unsharded parameters of group ``key``, before op ``first``."""
        rw, names = self.rw, self.units[key]
        if self.world_of(key) == 1:  # each shard copied into its unsharded storage, through a cast under a policy
            rows, cast = [], None
            for name in names:
                numel, dtype = self.shards[name].padded_numel, self.params[name].dtype
                if self.plan.mixed_precision:
                    point = rw.before(first, "fsdp.cast", unit, phase)
                    if cast is not None:
                        rw.retime(cast, last=point)
                    cast = rw.add(numel * self.compute[name], Role.COMMUNICATION, point, None, f"{name} (cast)", dtype)
                copy = rw.before(first, "fsdp.copy", unit, phase)
                name_unsharded = f"{name} (unsharded)"
                rows.append(rw.add(numel * self.compute[name], Role.PARAMETER, copy, last, name_unsharded, dtype, name))
            if cast is not None:
                rw.retime(cast, last=rw.lifetime(rows[-1])[0])
            return rows
        point = rw.before(first, "fsdp.all_gather_copy_out", unit, phase)
        rows = self.copy_out(key, point, last)
        for name in names:  # Shard(1): a temporary per parameter, chunk-cat into the unsharded one
            if self.placements[name].dim:
                size = self.shards[name].padded_numel * self.compute[name]
                rw.add(size, Role.COMMUNICATION, point, point, f"{name} (copy-out)", self.params[name].dtype)
        return rows

    def group_post_backward(self, key: str, unit: str, last: int, waits: bool) -> None:
        """``FSDPParamGroup.post_backward`` of group ``key`` after op ``last``; ``waits``: the unit's last group,
        which frees the held reduce-scatter inputs first."""
        rw = self.rw
        reshard = rw.after(last, "fsdp.reshard", unit, Phase.BACKWARD)
        for storage_id in self.unsharded.pop(key, []):
            rw.retime(storage_id, last=reshard)
        if waits:
            for storage_id in self.held_reduce_inputs:
                rw.retime(storage_id, last=reshard)
            self.held_reduce_inputs = []
        names = [name for name in self.units[key] if name in self.trained]
        if not names:
            return
        world = self.world_of(key)
        grads = {row.param: row for row in self.grads[key]}
        reduced = [grads[name].id for name in names]
        if world > 1:  # Shard(1): each gradient's chunks concatenated on dim 0, the gradient freed
            for index, name in enumerate(names):
                if self.placements[name].dim:
                    point = rw.after(last, "fsdp.chunk_cat", unit, Phase.BACKWARD)
                    rw.retime(reduced[index], last=point)
                    row = grads[name]
                    reduced[index] = rw.add(row.nbytes, Role.GRADIENT, point, None, f"{name} (chunks)", row.dtype, name)
        reduce_in = rw.after(last, "fsdp.reduce_scatter", unit, Phase.BACKWARD)
        size = sum(self.shards[n].padded_numel * self.reduce(n) for n in names)
        reduce_dtype = self.master_dtype(names)
        self.held_reduce_inputs.append(
            rw.add(size, Role.COMMUNICATION, reduce_in, None, f"reduce-scatter {key}", reduce_dtype)
        )
        for storage_id in reduced:
            rw.retime(storage_id, last=reduce_in)
        reduce_out = rw.after(last, "fsdp.reduce_scatter_output", unit, Phase.BACKWARD)
        zero_grad = max((row.freed_after for row in self.grads[key] if row.freed_after is not None), default=None)
        kept_until = None if zero_grad is None else Point(zero_grad, 0)
        sharded_bytes = sum(self.shards[n].padded_shard_numel * self.reduce(n) for n in names)
        name = f"sharded gradients {key}"
        rw.add(sharded_bytes, Role.GRADIENT, reduce_out, kept_until, name, reduce_dtype, stream=REDUCE_SCATTER_STREAM)
        if world == 1:  # reduce_output.copy_(reduce_scatter_input / gradient_divide_factor)
            name = f"reduce-scatter input / 1 {key}"
            rw.add(size, Role.COMMUNICATION, reduce_out, reduce_out, name, reduce_dtype, stream=REDUCE_SCATTER_STREAM)
