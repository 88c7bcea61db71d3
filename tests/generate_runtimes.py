"""``generate()`` itself, as the references for what the trace of it cannot be checked against in the other CPU
runs.

On GPUs that a CPU stands in for (device maps, offloaded caches): a tensor subclass claims to live on ``gpu:N``
(PyTorch's PrivateUse1 device renamed, with the Python backend's device guard) and holds a real CPU tensor. A
dispatch mode runs every op on the CPU tensors and gives its outputs the device PyTorch's own rules give them on GPUs:
a factory op's ``device`` argument, a copy's target (``.to("cpu")`` is host memory), otherwise the device of the
inputs, refusing inputs on different GPUs as CUDA does. So the runtimes' own code runs unchanged on real values
(accelerate's ``dispatch_model`` and its hooks, transformers' ``generate()`` and cache offloading), and the memory of
each GPU is counted from the storages each op makes, independently of the trace's own bookkeeping. What a GPU kernel
allocates inside itself is not seen; the CUDA streams the offloading cache synchronises are stood in for by ones that
wait for nothing. Code that picks a kernel by the device type takes its non-CPU path here: SDPA its math fallback,
MoE experts GPU-only ops (``histc`` of integers), so the checks run eager attention and dense models.

With the CPU allocator counted (sampling): ``generate()`` on plain CPU tensors under torch.profiler, whose memory
events include what kernels allocate inside themselves (``torch.multinomial``'s exponential sample), each in the
512-byte blocks the estimate counts, per phase.
"""

from __future__ import annotations

import multiprocessing
import weakref
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from unittest.mock import patch

import torch
import transformers
from accelerate import dispatch_model
from torch.autograd.profiler import record_function
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
from transformers.integrations import accelerate as hf_accelerate

from analysis.allocator import block_size
from analysis.measure import Generation
from tracer.resolve import ResolvedModel
from tracer.roles import Phase
from tracer.training import TrainingSetup

GPU = "gpu"
PHASE_MARK = "phase: "
CPU = torch.device("cpu")


def _gpus_exist() -> None:
    """PrivateUse1 renamed ``gpu``, with a device guard that does nothing, once per process."""
    if torch._C._get_privateuse1_backend_name() != GPU:
        _setup_privateuseone_for_python_backend(GPU)


class OnGpu(torch.Tensor):
    """A CPU tensor (``inner``) that says it lives on a GPU."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device | None = None, requires_grad: bool = False):
        if isinstance(inner, OnGpu):  # accelerate rewraps a moved parameter in its class: it stays as it is
            return inner
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=device,
            layout=inner.layout,
            requires_grad=inner.requires_grad,
        )
        wrapper.inner = inner
        return wrapper

    def data_ptr(self) -> int:  # accelerate keys tied weights by it
        return self.inner.data_ptr()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} ran on a GPU tensor outside the GPUs' mode")


class Gpus(TorchDispatchMode):
    """Runs every op on the CPU tensors and counts, per GPU, the storages its outputs make there (in the caching
    allocator's 512-byte blocks) from when they are made to when their last reference goes."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.peaks: dict[str, dict[int, int]] = {}  # phase -> GPU -> the most live at once
        self.phase = ""
        self._sizes: dict[int, tuple[int, int]] = {}

    def hold(self, tensor: torch.Tensor) -> None:
        """Count a GPU tensor that exists already (weights, the prompt)."""
        self._count(tensor.inner, tensor.device.index)

    def enter(self, phase: Phase) -> None:
        """From now on, what is live counts toward ``phase``'s peaks (a phase entered again keeps its peaks)."""
        self.phase = phase.value
        peaks = self.peaks.setdefault(self.phase, {})
        for device, live in self.live.items():
            peaks[device] = max(peaks.get(device, 0), live)

    def _count(self, tensor: torch.Tensor, device: int) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._sizes:
            return
        size = block_size(storage.nbytes())
        self._sizes[key] = (device, size)
        self.live[device] = self.live.get(device, 0) + size
        if self.phase:
            peaks = self.peaks[self.phase]
            peaks[device] = max(peaks.get(device, 0), self.live[device])
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        device, size = self._sizes.pop(key)
        self.live[device] -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:
            return args[0].device
        gpus = {leaf.device for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, OnGpu)}
        target = kwargs.get("device")
        if target is not None:  # a factory, or a copy to another device
            target = torch.device(target)
            kwargs = {**kwargs, "device": CPU}
        elif len(gpus) > 1 and func is not torch.ops.aten.copy_.default:
            raise RuntimeError(f"{func} on tensors of {sorted(map(str, gpus))}: expected all on one device")
        else:
            target = next(iter(gpus), CPU)
        if gpus and any(
            isinstance(leaf, torch.Tensor) and not isinstance(leaf, OnGpu) and leaf.dim() > 0
            for leaf in tree_leaves((args, kwargs))
        ):
            raise RuntimeError(f"{func} mixes host and GPU tensors")
        inner_args, inner_kwargs = tree_map(_unwrapped, (args, kwargs))
        out = func(*inner_args, **inner_kwargs)
        returns = func._schema.returns
        if func._schema.is_mutable and returns and returns[0].alias_info is not None and args:
            return args[0]  # in place: the same tensor
        if target.type != GPU:
            return out

        def on_gpu(leaf):
            if not isinstance(leaf, torch.Tensor):
                return leaf
            self._count(leaf, target.index)
            return OnGpu(leaf, target)

        return tree_map(on_gpu, out)


def _unwrapped(leaf):
    return leaf.inner if isinstance(leaf, OnGpu) else leaf


class _Constructors(TorchFunctionMode):
    """What builds a tensor below the dispatcher: ``torch.tensor(data, device=gpu)`` is built on the CPU and copied,
    and a list in an index (``ids[:, [-1, 0]]``) becomes an index tensor on the GPU first."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor) and device is not None and torch.device(device).type == GPU:
            return func(*args, **{**kwargs, "device": CPU}).to(device)
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], OnGpu):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            index = tuple(torch.tensor(i).to(args[0].device) if isinstance(i, list) else i for i in index)
            args = (args[0], index, *args[2:])
        return func(*args, **kwargs)


class _Stream:
    """A CUDA stream that waits for nothing, and a context that runs on it (the offloading cache's prefetch)."""

    def wait_stream(self, other) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


@contextmanager
def on_gpus() -> Iterator[Gpus]:
    _gpus_exist()
    gpus = Gpus()
    with ExitStack() as stack:
        stack.enter_context(patch.object(torch.cuda, "default_stream", lambda device=None: _Stream()))
        stack.enter_context(patch.object(torch, "Stream", _Stream))
        stack.enter_context(_Constructors())
        stack.enter_context(gpus)
        yield gpus


def _put(net: torch.nn.Module, placed: dict[str, int]) -> None:
    """Each parameter and buffer where from_pretrained loads it: on the GPU the map gives it (transformers'
    ``expand_device_map``), or, for what the map does not cover (a non-persistent buffer of a module it splits),
    in host memory."""
    for name, module in net.named_modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        devices = hf_accelerate.expand_device_map(placed, [f"{name}.{key}".lstrip(".") for key, _ in tensors])
        for (key, tensor), device in zip(tensors, devices.values(), strict=True):
            if not isinstance(device, int):
                continue
            on_gpu = OnGpu(tensor.data, torch.device(GPU, device))
            if key in module._parameters:
                module._parameters[key] = torch.nn.Parameter(on_gpu, requires_grad=False)
            else:
                module._buffers[key] = on_gpu


def generate_peaks(
    model: ResolvedModel, setup: TrainingSetup, device_map: dict[str, int] | None = None
) -> dict[str, list[int]]:
    """Each GPU's peak in the prefill and over the decode steps of ``generate()`` (the second of two), the model's
    weights and the prompt included: with ``device_map``, the model dispatched by accelerate's own ``dispatch_model``
    as ``from_pretrained`` does; without, all of it on one GPU. It runs in a process of its own: the stand-in GPUs,
    once registered, stay PyTorch's current accelerator (``torch.Stream()`` is made on them), which the other tests
    must not see."""
    global _STAND_IN
    if _STAND_IN is None:
        _STAND_IN = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    return _STAND_IN.submit(_generate_peaks, model, setup, device_map).result()


_STAND_IN: ProcessPoolExecutor | None = None


def _generate_peaks(
    model: ResolvedModel, setup: TrainingSetup, device_map: dict[str, int] | None
) -> dict[str, list[int]]:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    net = model.build(setup)
    placed = device_map or {"": 0}
    batch = model.batch(setup, "cpu")
    with on_gpus() as gpus, torch.no_grad():
        _put(net, placed)
        main = min(placed.values())  # the first of the set of the map's GPU numbers, dispatch_model's main device
        if len(set(placed.values())) > 1:  # as from_pretrained: one GPU needs no hooks
            dispatch_model(
                net,
                {name: f"{GPU}:{device}" for name, device in device_map.items()},
                main_device=f"{GPU}:{main}",
                skip_keys=net._skip_keys_device_placement,
            )
        batch.input_ids = OnGpu(batch.input_ids, torch.device(GPU, main))  # on model.device, the embedding's GPU
        Generation(net, setup).run(batch)
        for tensor in (*net.parameters(), *net.buffers(), batch.input_ids):
            if isinstance(tensor, OnGpu):
                gpus.hold(tensor)
        Generation(net, setup).run(batch, on_phase=gpus.enter)
    devices = range(max(placed.values()) + 1)
    return {phase: [peaks.get(device, 0) for device in devices] for phase, peaks in gpus.peaks.items()}


def auto_device_map(model: ResolvedModel, setup: TrainingSetup, strategy: str, free_bytes: list[int]) -> dict:
    """``from_pretrained(device_map=strategy)``'s map (transformers' ``_get_device_map``) for the model on a meta
    device, with GPUs whose free memory accelerate reads as ``free_bytes``."""
    with torch.device("meta"):
        net = model.build(setup)
    memory = dict(enumerate(free_bytes)) | {"cpu": 2**60}
    with patch.object(hf_accelerate, "accelerate_max_memory", lambda max_memory=None: dict(memory)):
        return dict(hf_accelerate._get_device_map(net, strategy, None, None))


def allocator_phase_peaks(model: ResolvedModel, setup: TrainingSetup) -> dict[str, int]:
    """The CPU allocator's peak in the prefill and over the decode steps of ``generate()`` (the second of two): what
    the model and the prompt hold, plus the highest running sum of the allocations and frees torch.profiler reports
    (each in 512-byte blocks) in each phase. What generate() does before the prefill counts toward it."""
    torch.manual_seed(0)
    net = model.build(setup)
    batch = model.batch(setup, "cpu")
    Generation(net, setup).run(batch)
    held = {
        storage.data_ptr(): block_size(storage.nbytes())
        for tensor in (*net.parameters(), *net.buffers(), batch.input_ids)
        for storage in get_untyped_storages(tensor)
    }

    def mark(phase: Phase) -> None:
        with record_function(f"{PHASE_MARK}{phase.value}"):
            pass

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        Generation(net, setup).run(batch, on_phase=mark)
    events = sorted(
        (event.start_ns(), event.name(), event.nbytes())
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]" or event.name().startswith(PHASE_MARK)
    )
    peaks: dict[str, int] = {}
    phase, now = Phase.PREFILL.value, 0
    for _, name, nbytes in events:
        if name.startswith(PHASE_MARK):
            phase = name.removeprefix(PHASE_MARK)
            peaks[phase] = max(peaks.get(phase, 0), now)
            continue
        now += block_size(nbytes) if nbytes > 0 else -block_size(-nbytes)
        peaks[phase] = max(peaks.get(phase, 0), now)
    return {name: sum(held.values()) + peak for name, peak in peaks.items()}
