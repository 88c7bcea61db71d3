"""DeepSpeed ZeRO stages 1, 2 and 3 (DeepSpeed 0.19, deepspeed/runtime/zero), for one data-parallel rank,
with the engine's default configuration.

What every stage keeps (``DeepSpeedZeroOptimizer`` in stage_1_and_2.py, ``DeepSpeedZeroOptimizer_Stage3``
in stage3.py): an fp32 copy of the rank's partition of the parameters (the master weights, made even when
training in fp32) and the optimizer's states of that partition only, in place of per-parameter states.
The optimizer steps on the partition: its gradient is made fp32 for the step, and the temporaries of the
update are partition-sized.

* Stage 1: gradients are computed in full as on one GPU; after backward they are reduced through the
  gradient bucket and each rank keeps its partition (``reduce_gradients``).
* Stage 2: each gradient is copied into the bucket as soon as it is ready and freed
  (``reduce_independent_p_g_buckets_and_remove_grads``); when the bucket fills it is reduced and the rank
  keeps its partition (``grads_in_partition``).
* Stage 3: parameters are partitioned too, per parameter; a module's are all-gathered before it runs
  and released after, unless they will be used again soon (``max_reuse_distance``), with the next modules
  prefetched (``prefetch_bucket_size``); parameters of at most ``param_persistence_threshold`` elements stay
  whole. Gradients go through the bucket into an fp32 partition buffer kept for the whole step
  (``grad_partitions_flat_buffer``).

The gradient bucket (``ipg_buckets``) has ``reduce_bucket_size`` elements of the training dtype whatever
the model's size; stages 1 and 2 allocate it when backward starts and free it after the step (a second one
with ``overlap_comm``, which is off for them by default: ``DeepSpeedZeroConfig.overlap_comm_valid``), stage 3
keeps one from initialization.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass
from itertools import accumulate

from strategies.collectives import gradient_bytes, recorded, sharded_data_parallel, updated_parameters_gather
from strategies.rewrite import Point, Rewrite, unit_windows
from tracer.errors import UserError
from tracer.graph import (
    DATA_PARALLEL,
    DEVICE_TO_HOST,
    HOST_TO_DEVICE,
    REDUCE_SCATTER,
    Collective,
    StepGraph,
    StorageRow,
    Transfer,
)
from tracer.roles import Phase, Role
from tracer.trace import element_size
from tracer.training import TrainingSetup

AUTO = "auto"
# Flat groups are padded to a multiple of 2 x world elements (nccl_start_alignment_factor in stage_1_and_2.py).
ALIGNMENT_FACTOR = 2
FLOAT32_BYTES = element_size("float32")


@dataclass(frozen=True)
class ZeroConfig:
    """The ``zero_optimization`` keys that change memory, in elements; DeepSpeed's defaults
    (``DeepSpeedZeroConfig``, deepspeed/runtime/zero/config.py). A size may be ``"auto"``, which the Hugging
    Face Trainer fills from the model's hidden size (:meth:`resolved`)."""

    reduce_bucket_size: int | str = 500_000_000
    stage3_prefetch_bucket_size: int | str = 50_000_000
    stage3_param_persistence_threshold: int | str = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default, on for stage 3 only (overlap_comm_valid)

    def resolved(self, hidden_size: int | None) -> ZeroConfig:
        """``"auto"`` sizes as ``HfTrainerDeepSpeedConfig.trainer_config_finalize`` fills them (transformers
        integrations/deepspeed.py): hidden x hidden for the bucket, 0.9 of that for the prefetch, 10 x hidden
        for the persistence threshold. ``hidden_size`` None: a model without a config, which cannot fill them."""
        if hidden_size is None:
            if any(getattr(self, key.name) == AUTO for key in dataclasses.fields(self)):
                raise UserError(
                    "DeepSpeed's \"auto\" sizes are filled from the model config's hidden_size, which a custom "
                    "model has none of: give them as numbers in the DeepSpeed config."
                )
            return self
        auto = {
            "reduce_bucket_size": hidden_size * hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
            "stage3_param_persistence_threshold": 10 * hidden_size,
        }
        return dataclasses.replace(self, **{key: value for key, value in auto.items() if getattr(self, key) == AUTO})

    def overlaps(self, stage: int) -> bool:
        return self.overlap_comm if self.overlap_comm is not None else stage == 3

    def describe(self, stage: int) -> str:
        keys = ["reduce_bucket_size"]
        if stage == 3:
            keys += [
                "stage3_prefetch_bucket_size",
                "stage3_max_live_parameters",
                "stage3_max_reuse_distance",
                "stage3_param_persistence_threshold",
            ]
        sizes = ", ".join(f"{key} {_size(getattr(self, key))}" for key in keys)
        return f"{sizes}, overlap_comm {str(self.overlaps(stage)).lower()}"


def _size(value: int | str) -> str:
    return value if isinstance(value, str) else f"{value:,}"


@dataclass(frozen=True)
class DeepSpeedPlan:
    stage: int  # 1, 2 or 3
    world: int  # size of the data-parallel group
    rank: int = 0
    offload_optimizer: bool = False  # offload_optimizer.device = "cpu" (ZeRO-Offload)
    offload_params: bool = False  # offload_param.device = "cpu" (ZeRO-Infinity, stage 3 only)
    config: ZeroConfig = ZeroConfig()


@dataclass(frozen=True)
class DeepSpeedZero:
    """The runtime of ``--engine deepspeed --zero 1/2/3``."""

    stage: int
    world: int
    offload_optimizer: bool = False
    offload_params: bool = False
    config: ZeroConfig = ZeroConfig()

    @property
    def name(self) -> str:
        return f"DeepSpeed ZeRO-{self.stage}"

    @property
    def note(self) -> str:
        return (
            f"DeepSpeed ZeRO-{self.stage}: {self.config.describe(self.stage)}; fp32 master weights and optimizer "
            "states of the rank's partition"
        )

    def traced_setup(self, setup: TrainingSetup) -> tuple[TrainingSetup, str | None]:
        """DeepSpeed's bf16/fp16 mode: the model in the low-precision dtype, fp32 master weights in the
        optimizer, no autocast. The engine casts every floating-point parameter to that dtype
        (``DeepSpeedEngine._cast_module_mixed_precision``), peft's fp32 adapters included."""
        low = setup.mixed_precision or (setup.dtype if setup.dtype != "fp32" else None)
        if low is None:
            return setup, None
        lora = setup.lora and dataclasses.replace(setup.lora, float32_adapters=False)
        note = f"DeepSpeed {low}: the model in {low}, fp32 master weights in the ZeRO optimizer, no autocast"
        if setup.lora:
            note += f"; the engine casts the LoRA adapters to {low}"
        return dataclasses.replace(setup, dtype=low, mixed_precision=None, lora=lora), note

    def distinct_ranks(self, step: StepGraph) -> list[int]:
        """Every partition is padded to one size, so every rank is alike."""
        return [0]

    def apply(self, step: StepGraph, setup: TrainingSetup, rank: int) -> StepGraph:
        plan = DeepSpeedPlan(self.stage, self.world, rank, self.offload_optimizer, self.offload_params, self.config)
        return recorded(deepspeed(step, plan), *self.collectives(step))

    def collectives(self, step: StepGraph) -> list[Collective]:
        """Stage 3 gathers and reduces per module like FSDP2 (``overlap_comm`` is on by default for it). Below
        stage 3 ``overlap_comm`` is off: gradients are reduced on the compute stream (every micro-step for stage
        2, at the accumulation boundary for stage 1) and the updated 16-bit partitions all-gathered after the
        optimizer step."""
        if self.stage == 3:
            return sharded_data_parallel(step, reshard_after_forward=True, reduce_bytes=None)
        return [
            Collective(
                REDUCE_SCATTER,
                DATA_PARALLEL,
                gradient_bytes(step),
                Phase.BACKWARD,
                every_micro_step=self.stage == 2,
                overlapped=False,
                what="gradient buckets, on the compute stream",
            ),
            updated_parameters_gather(step, "updated 16-bit partitions after the optimizer step"),
        ]


def deepspeed(step: StepGraph, plan: DeepSpeedPlan) -> StepGraph:
    """The step of rank ``plan.rank`` under DeepSpeed ZeRO ``plan.stage``."""
    if plan.stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage {plan.stage} is not one of 1, 2, 3")
    if plan.world < 2 and not plan.offload_optimizer:
        raise ValueError("ZeRO without offload needs a data-parallel group of at least 2 ranks")
    if plan.offload_params and plan.stage != 3:
        raise ValueError("parameters are offloaded by ZeRO stage 3 only")
    return _DeepSpeed(step, plan).build()


def partition_numel(numel: int, world: int) -> int:
    """Elements of one rank's partition of a flat group of ``numel`` (stages 1 and 2)."""
    aligned = -(-numel // (ALIGNMENT_FACTOR * world)) * ALIGNMENT_FACTOR * world
    return aligned // world


def parameter_partition_numel(numel: int, world: int) -> int:
    """Elements of one rank's partition of one parameter (stage 3: ``ds_tensor``, padded to equal parts)."""
    return -(-numel // world)


class _DeepSpeed:
    def __init__(self, step: StepGraph, plan: DeepSpeedPlan) -> None:
        self.step, self.plan = step, plan
        self.config = plan.config
        if any(isinstance(getattr(plan.config, key.name), str) for key in dataclasses.fields(plan.config)):
            raise ValueError(f"resolve the 'auto' sizes of {plan.config} first (ZeroConfig.resolved)")
        self.rw = Rewrite(step)
        self.params = {
            row.param: row for row in step.storages.values() if row.role is Role.PARAMETER and row.param is not None
        }
        # The optimizer, and so the fp32 partition, covers trainable parameters only (frozen ones, as LoRA
        # leaves the base, have no gradient).
        trainable = {row.param for row in step.storages.values() if row.role is Role.GRADIENT}
        self.dtype = next(row.dtype for name, row in self.params.items() if name in trainable or not trainable)
        self.bytes = element_size(self.dtype)
        # Elements of the training dtype. Packed 4-bit weights are stored in it under ZeRO-3, as PEFT's QLoRA
        # recipe sets (``bnb_4bit_quant_storage``), so that they partition and gather like any parameter.
        self.numel = {name: -(-row.nbytes // self.bytes) for name, row in self.params.items()}
        self.gradients = [row for row in step.storages.values() if row.role is Role.GRADIENT]
        # Later micro-steps' gradients: the trace adds them into .grad, while ZeRO-2 and 3 find .grad empty
        # (it was copied into the bucket and freed) and reduce them into the partition the same way.
        self.accumulated = [
            row
            for row in step.storages.values()
            if row.role is not Role.GRADIENT and row.param in trainable and step.made_in(row, Phase.BACKWARD)
        ]
        self.backward = _span(step, Phase.BACKWARD)
        self._optimizer_storages: list[int] = []  # what the optimizer keeps and makes, offloaded with it
        self._fetched: dict[Phase, dict[str, int]] = {phase: defaultdict(int) for phase in Phase}
        self._update_temporaries: list[int] = []
        self.optimizer = _span(step, Phase.OPTIMIZER)
        trained = {name: numel for name, numel in self.numel.items() if name in trainable}
        self.total = sum(trained.values())
        if plan.stage == 3:
            self.partition = sum(parameter_partition_numel(numel, plan.world) for numel in trained.values())
        else:
            self.partition = partition_numel(self.total, plan.world)

    def build(self) -> StepGraph:
        self.partition_optimizer()
        if self.plan.stage == 3:
            self.partition_parameters()
        self.gradient_buckets()
        if self.plan.offload_optimizer:
            self.offload_optimizer()
        if self.plan.offload_params:
            self.offload_parameters()
        return self.rw.build()

    # ZeRO-Offload and ZeRO-Infinity.

    def offload_optimizer(self) -> None:
        """The optimizer steps on the CPU (``DeepSpeedCPUAdam``, which ZeRO-Offload requires by default:
        ``zero_force_ds_cpu_optimizer``; its kernel updates in place): the fp32 partition (master weights,
        states, gradient) lives in pinned host memory, with a 16-bit copy of the partition to send the
        updated weights back (``param_buffer_of_bit16_for_cpu_offload_groups``). Reduced gradients go to the
        host as they come, through a staging buffer the size of the largest parameter on each side
        (``temp_grad_buffer_for_gpu_offload`` and ``..._for_cpu_offload``, stages 1 and 2)."""
        for storage_id in self._optimizer_storages:
            self.rw.to_host(storage_id)
        for storage_id in self._update_temporaries:  # DeepSpeedCPUAdam updates the partition in place
            self.rw.resize(storage_id, 0)
        part = self.partition * self.bytes
        self.rw.transfers += [
            Transfer(Phase.BACKWARD, DEVICE_TO_HOST, part, "reduced gradients into the fp32 partition", "backward"),
            Transfer(Phase.OPTIMIZER, HOST_TO_DEVICE, part, "updated 16-bit partition", ""),
        ]
        largest = max(self.numel.values()) * self.bytes
        self.rw.add(
            self.partition * self.bytes,
            Role.OPTIMIZER_STATE,
            None,
            None,
            "16-bit partition",
            self.dtype,
            on_device=False,
        )
        if self.plan.stage != 3:
            self.rw.add(largest, Role.COMMUNICATION, None, None, "gradient offload staging", self.dtype)
            self.rw.add(
                largest, Role.COMMUNICATION, None, None, "gradient offload staging (host)", self.dtype, on_device=False
            )

    def offload_parameters(self) -> None:
        """The 16-bit partitions of the parameters live in host memory; each fetch first copies the module's
        partitions to the device, then gathers them."""
        for name in self._partitioned():
            self.rw.to_host(self.params[name].id)
        for phase in (Phase.FORWARD, Phase.BACKWARD):
            fetched = sum(self._fetched[phase].values())
            what = f"parameter partitions fetched in {phase.value}"
            self.rw.transfers.append(Transfer(phase, HOST_TO_DEVICE, fetched, what, f"{phase.value} (prefetch)"))

    # The optimizer on the fp32 partition.

    def partition_optimizer(self) -> None:
        first, last = self.optimizer
        states: dict[str, int] = defaultdict(int)
        for row in self.step.storages.values():
            if row.param not in self.params or not self._param_sized(row):
                continue
            if row.role is Role.OPTIMIZER_STATE:
                states[row.name.rpartition(".")[2]] += 1
                self.rw.resize(row.id, 0)
            elif self.step.made_in(row, Phase.OPTIMIZER):  # update temporaries, now of the fp32 partition
                element = row.nbytes // self.numel[row.param] * FLOAT32_BYTES // self.bytes
                self.rw.resize(row.id, self.numel[row.param] * self.partition // self.total * element)
                self._update_temporaries.append(row.id)
        part32 = self.partition * FLOAT32_BYTES
        kept = [self.rw.add(part32, Role.OPTIMIZER_STATE, None, None, "fp32 master partition", "float32")]
        for kind in states:
            kept.append(self.rw.add(part32, Role.OPTIMIZER_STATE, None, None, f"{kind} of the partition", "float32"))
        self._optimizer_storages += kept
        if self.plan.stage == 3:  # the fp32 gradient partitions are kept all along (gradient_buckets)
            return
        if self.plan.offload_optimizer:  # reduced gradients accumulate straight into a pinned fp32 partition
            self._optimizer_storages.append(
                self.rw.add(part32, Role.GRADIENT, None, None, "fp32 gradient partition", "float32")
            )
            return
        flat = self.rw.before(first, "deepspeed.flatten_gradient_partition", "", Phase.OPTIMIZER)
        cast = self.rw.before(first, "deepspeed.gradient_partition_to_fp32", "", Phase.OPTIMIZER)
        self.rw.add(self.partition * self.bytes, Role.TEMPORARY, flat, cast, "flat gradient partition", self.dtype)
        self.rw.add(part32, Role.GRADIENT, cast, Point(last, 0), "fp32 gradient partition", "float32")

    # Gradients: through the bucket into the rank's partition.

    def gradient_buckets(self) -> None:
        stage, (backward_first, backward_last) = self.plan.stage, self.backward
        bucket, step_end = self.config.reduce_bucket_size * self.bytes, Point(self.optimizer[1], 0)
        if stage == 3:
            self.rw.add(bucket, Role.COMMUNICATION, None, None, "gradient bucket", self.dtype)
            part = self.partition * FLOAT32_BYTES
            partitions = self.rw.add(part, Role.GRADIENT, None, None, "fp32 gradient partitions", "float32")
            self._optimizer_storages.append(partitions)
        else:  # with overlap_comm, a second bucket is filled while the first is reduced (setup_buckets)
            for what in ("gradient bucket", "second gradient bucket")[: 1 + self.config.overlaps(stage)]:
                self.rw.add(bucket, Role.COMMUNICATION, Point(backward_first, 0), step_end, what, self.dtype)
        if stage == 1:  # full gradients until backward ends, then reduced through the bucket
            reduced = self.rw.after(backward_last, "deepspeed.reduce_gradients", "", Phase.BACKWARD)
            for row in self.gradients:
                self.rw.retime(row.id, last=reduced)
        else:  # each gradient copied into the bucket and freed as soon as it is ready, every micro-step
            for row in sorted(self.gradients + self.accumulated, key=lambda row: row.producer or 0):
                point = self.rw.after(row.producer, "deepspeed.copy_into_bucket", row.module, Phase.BACKWARD)
                self.rw.retime(row.id, last=point)
            reduced = self.rw.after(self._first_bucket_reduce(), "deepspeed.reduce_bucket", "", Phase.BACKWARD)
        if stage != 3 and not self.plan.offload_optimizer:
            part = self.partition * self.bytes
            self.rw.add(part, Role.GRADIENT, reduced, step_end, "gradient partition", self.dtype)

    def _first_bucket_reduce(self) -> int:
        """The op after which the bucket first fills, or the end of backward."""
        filled = 0
        for row in sorted(self.gradients, key=lambda row: row.producer or 0):
            filled += self.numel.get(row.param, 0)
            if filled > self.config.reduce_bucket_size:
                return row.producer
        return self.backward[1]

    # Stage 3: parameters.

    def partition_parameters(self) -> None:
        for name in self._partitioned():
            row = self.params[name]
            self.rw.resize(row.id, parameter_partition_numel(self.numel[name], self.plan.world) * self.bytes)
        units = self._units()
        for passes in self.step.micro_steps():
            self._fetch_per_module(units, unit_windows(self.step, {module: (module,) for module in units}, passes))

    def _fetch_per_module(self, units: dict[str, list[str]], windows) -> None:
        """One micro-step's gathers and releases, module by module."""
        order = {
            phase: sorted((m for m in units if phase in windows.get(m, {})), key=lambda m: windows[m][phase][0])
            for phase in (Phase.FORWARD, Phase.BACKWARD)
        }
        kept = self._kept_after_forward(order, windows, units)
        gathered: dict[str, int] = {}
        for phase in (Phase.FORWARD, Phase.BACKWARD):
            sequence = order[phase]
            for position, module in enumerate(sequence):
                first, last = windows[module][phase]
                if module not in gathered:
                    point = self.rw.before(first, "deepspeed.all_gather", module, phase)
                    gathered[module] = self._gather(units[module], point, module)
                self._prefetch(sequence[position + 1 :], units, gathered, first, phase)
                if phase is Phase.FORWARD and module in kept:
                    continue
                self.rw.retime(gathered.pop(module), last=self.rw.after(last, "deepspeed.release", module, phase))

    def _units(self) -> dict[str, list[str]]:
        """Modules and the partitioned parameters they fetch: their own, and for a tied lm_head the
        embedding's (it is the lm_head's parameter too)."""
        units: dict[str, list[str]] = defaultdict(list)
        for name in self._partitioned():
            units[name.rpartition(".")[0]].append(name)
        structure = self.step.structure
        if structure.output_embedding and structure.output_embedding not in units:
            units[structure.output_embedding] = list(units.get(structure.input_embedding, []))
        return dict(units)

    def _gather(self, names: list[str], point: Point, module: str) -> int:
        size = sum(self.numel[name] for name in names) * self.bytes
        if self.plan.offload_params:  # the rank's partitions come over from the host first
            copied = sum(parameter_partition_numel(self.numel[name], self.plan.world) for name in names) * self.bytes
            self.rw.add(copied, Role.COMMUNICATION, point, point, f"{module} (partition from host)", self.dtype)
            self._fetched[self.step.ops[point.original].phase][module] += copied
        return self.rw.add(size, Role.PARAMETER, point, None, f"{module} (gathered)", self.dtype)

    def _prefetch(
        self, upcoming: list[str], units: dict[str, list[str]], gathered: dict[str, int], first: int, phase: Phase
    ) -> None:
        """Gather the next modules while this one runs, until ``prefetch_bucket_size`` elements are in
        flight or ``max_live_parameters`` are gathered (``fetch_sub_module``)."""
        live = sum(self._unit_numel(units[m]) for m in gathered)
        budget = min(self.config.stage3_max_live_parameters - live, self.config.stage3_prefetch_bucket_size)
        fetched = 0
        for module in upcoming:
            if fetched >= budget:
                break
            if module in gathered:
                continue
            point = self.rw.before(first, "deepspeed.prefetch", module, phase)
            gathered[module] = self._gather(units[module], point, module)
            fetched += self._unit_numel(units[module])

    def _kept_after_forward(self, order, windows, units: dict[str, list[str]]) -> set[str]:
        """Modules whose parameters are not released after forward: those used again before
        ``max_reuse_distance`` elements of other modules' parameters are fetched (``__params_to_release``)."""
        uses = sorted((windows[m][phase][0], m) for phase in (Phase.FORWARD, Phase.BACKWARD) for m in order[phase])
        starts = [index for index, _ in uses]
        fetched_before = list(accumulate((self._unit_numel(units[m]) for _, m in uses), initial=0))
        kept = set()
        for module in order[Phase.FORWARD]:
            if Phase.BACKWARD not in windows[module]:
                continue
            # the uses strictly between its forward's last op and its backward's first: none of them its own
            start, end = windows[module][Phase.FORWARD][1], windows[module][Phase.BACKWARD][0]
            between = fetched_before[bisect_left(starts, end)] - fetched_before[bisect_right(starts, start)]
            if between < self.config.stage3_max_reuse_distance:
                kept.add(module)
        return kept

    def _unit_numel(self, names: list[str]) -> int:
        return sum(self.numel[name] for name in names)

    def _partitioned(self) -> list[str]:
        """Parameters stage 3 partitions: all but those of at most ``param_persistence_threshold`` elements."""
        return [name for name, numel in self.numel.items() if numel > self.config.stage3_param_persistence_threshold]

    def _param_sized(self, row: StorageRow) -> bool:
        return row.numel == self.params[row.param].numel


def _span(step: StepGraph, phase: Phase) -> tuple[int, int]:
    indices = [op.index for op in step.ops if op.phase is phase]
    return indices[0], indices[-1]
