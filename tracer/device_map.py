"""accelerate's ``device_map`` for generation over several GPUs: which GPU each module lands on, as
``from_pretrained(device_map="auto")`` places it, and the copies accelerate's hooks make between GPUs.

The placement is transformers' own (transformers 5.24, integrations/accelerate.py ``_get_device_map``:
``get_balanced_memory``, then ``infer_auto_device_map`` with the model's ``_no_split_modules``) run on the model the
trace builds, with the memory accelerate's ``get_max_memory`` reads from each GPU when nothing is given: its free
memory (``torch.cuda.mem_get_info``) once the CUDA context exists. The hooks are accelerate's own (1.15,
big_modeling.py ``dispatch_model``): an ``AlignDevicesHook`` on every placed module moves its inputs to its GPU, and
the one on the model moves the outputs back to the GPU of the inputs. On the CPU trace the weights stay where they are
and every storage carries the GPU it is on: a parameter the GPU its module is placed on, a hook's ``.to(gpu)`` a copy
counted on that GPU, any other op's output the GPU of its inputs, and a tensor made from nothing (``torch.arange``,
``torch.zeros``) the GPU of the module running, whose inputs the hooks put there.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from unittest.mock import patch

import torch
from accelerate import dispatch_model
from accelerate import hooks as accelerate_hooks
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers.integrations import accelerate as hf_accelerate

from tracer.errors import UserError
from tracer.gpus import Gpu
from tracer.recorder import StepRecorder
from tracer.trace import Storage
from tracer.training import DeviceMap
from tracer.units import format_bytes

# What get_max_memory gives the host when nothing is given (the available RAM, of which transformers keeps 90%): any
# module placed there is refused below, so only its being larger than the model matters.
HOST_BYTES = 2**60


def free_memory(gpu: Gpu) -> int:
    """What ``torch.cuda.mem_get_info`` reports free on an idle GPU once accelerate's probe tensor has created the
    CUDA context (transformers adds back the caching allocator's unused reserve, so the probe's block counts free)."""
    return gpu.memory_bytes - gpu.context_bytes


def place_modules(model: nn.Module, device_map: DeviceMap, free_bytes: int) -> dict[str, int]:
    """Module path -> GPU, as ``from_pretrained(device_map=device_map.strategy)`` computes it for the model with
    ``device_map.gpus`` idle GPUs of ``free_bytes`` free each. A model that does not fit them, which accelerate would
    offload in part to the host or the disk, is refused."""
    budget = dict.fromkeys(range(device_map.gpus), free_bytes) | {"cpu": HOST_BYTES}

    def max_memory(max_memory=None):  # accelerate's get_max_memory, as it reads these GPUs
        return dict(budget) if max_memory is None else max_memory

    with patch.object(hf_accelerate, "accelerate_max_memory", max_memory), _quiet():
        placed = hf_accelerate._get_device_map(model, device_map.strategy, None, None)
    offloaded = [name for name, device in placed.items() if not isinstance(device, int)]
    if offloaded:
        raise UserError(
            f"The model does not fit {device_map.gpus} GPUs of {format_bytes(free_bytes)} free each: accelerate would "
            f"offload {', '.join(offloaded[:3])}{' ...' if len(offloaded) > 3 else ''} to the host, which is not "
            "modelled. Use more GPUs, larger ones (--gpu), or tensor parallelism (--tp)."
        )
    return dict(placed)


class DevicePlacement:
    """The GPU of every storage of a trace over a device map (``StepRecorder``'s ``placement``), and accelerate's
    hooks on the traced model."""

    def __init__(self, placed: dict[str, int]) -> None:
        self.placed = placed
        # dispatch_model's main device, the first GPU of the map (the first of the set of them, which for small
        # numbers is the lowest): the model's hook runs it there, and generate()'s inputs are put on model.device,
        # the embedding's GPU, the same one (balanced_low_0 leaves GPU 0 without weights, and then unused)
        self.main = min(placed.values())
        # longest paths first, so that a module takes the device of its nearest placed ancestor
        self._prefixes = sorted(placed, key=len, reverse=True)

    def module_device(self, path: str) -> int:
        """The GPU a module runs on: that of itself or its nearest placed ancestor; the model's own code runs on
        the main GPU, where its hook puts the inputs."""
        for prefix in self._prefixes:
            if prefix == "" or path == prefix or path.startswith(prefix + "."):
                return self.placed[prefix]
        return self.main

    def device_of_new(self, module: str, inputs: list[Storage]) -> int:
        """An op's outputs are on the GPU of its inputs (of those that hold elements: a 0-dim one may be a host
        scalar); a tensor made from nothing, on the GPU of the module running."""
        holding = [storage for storage in inputs if storage.shape and storage.nbytes]
        return holding[0].device if holding else self.module_device(module)

    def place_existing(self, recorder: StepRecorder, model: nn.Module) -> None:
        """Each parameter and buffer where from_pretrained loads it (``expand_device_map``): on the GPU of its
        module, or, for what the map does not cover (a non-persistent buffer of a module it splits), in host memory."""
        tensors = dict((*model.named_parameters(), *model.named_buffers()))
        for name, device in hf_accelerate.expand_device_map(self.placed, list(tensors)).items():
            if isinstance(device, int):
                recorder.place(tensors[name], device)
            else:
                recorder.place(tensors[name], on_device=False)

    def describe(self) -> dict[str, str]:
        """Which modules each GPU holds, for the report; runs of numbered layers folded (``model.layers.0-13``)."""
        by_device: dict[int, list[str]] = {}
        for name, device in self.placed.items():
            by_device.setdefault(device, []).append(name)
        gpus = [f"GPU {device}: {_folded(names)}" for device, names in sorted(by_device.items())]
        return {"placement": "; ".join(gpus)}

    def dispatch(self, model: nn.Module) -> None:
        """accelerate's ``dispatch_model`` hooks on ``model``, as ``from_pretrained`` attaches them where the map
        holds several GPUs (with the model's ``_skip_keys_device_placement``), without moving its weights."""
        if len(set(self.placed.values())) == 1:  # the model moved to its one GPU whole, without hooks
            return
        with patch.object(accelerate_hooks.AlignDevicesHook, "init_hook", lambda hook, module: module), _quiet():
            dispatch_model(model, self.placed, skip_keys=model._skip_keys_device_placement)

    @contextmanager
    def copies(self, recorder: StepRecorder) -> Iterator[None]:
        """While recording: each ``.to(gpu)`` a hook asks for of a tensor on another GPU is a copy on that GPU, as on
        the GPUs (``send_to_device``); the GPU of a hook's inputs is that of their storage (``find_device``)."""

        def find_device(data) -> int | None:  # accelerate's, in the order it looks
            if isinstance(data, torch.Tensor):
                return recorder.device_of(data)
            items = data.values() if isinstance(data, Mapping) else data if isinstance(data, tuple | list) else ()
            return next((device for item in items if (device := find_device(item)) is not None), None)

        with ExitStack() as stack:
            stack.enter_context(patch.object(accelerate_hooks, "find_device", find_device))
            stack.enter_context(_Copies(self, recorder))
            yield


class _Copies(TorchFunctionMode):
    """``tensor.to(gpu)``: the tensor itself when it is on that GPU, else a copy counted there. What the hooks pass is
    the device map's GPU number; what model code passes is another tensor's device (``x.to(keys.device)``), which is
    the GPU of the module running (on the CPU trace, the CPU)."""

    def __init__(self, placement: DevicePlacement, recorder: StepRecorder) -> None:
        super().__init__()
        self.placement, self.recorder = placement, recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            device = args[1] if len(args) > 1 else kwargs.get("device")
            if isinstance(device, torch.device):
                device = self.placement.module_device(self.recorder.scope.current())
            if isinstance(device, int):
                tensor, rest = args[0], {key: value for key, value in kwargs.items() if key != "device"}
                if self.recorder.device_of(tensor) == device and self.recorder.on_device(tensor):
                    return tensor.to(*args[2:], **rest)
                copy = tensor.to(*args[2:], **rest | {"copy": True})
                self.recorder.place(copy, device, name=f"copy to GPU {device}")
                return copy
        return func(*args, **kwargs)


def _folded(names: list[str]) -> str:
    """``model.layers.0, model.layers.1, model.layers.2`` as ``model.layers.0-2``."""
    runs: list[list] = []
    for name in names:
        stem, _, index = name.rpartition(".")
        if index.isdigit() and runs and runs[-1][0] == stem and runs[-1][2] == int(index) - 1:
            runs[-1][2] = int(index)
        elif index.isdigit():
            runs.append([stem, int(index), int(index)])
        else:
            runs.append([name, None, None])
    return ", ".join(
        stem if first is None else f"{stem}.{first}" + (f"-{last}" if last != first else "")
        for stem, first, last in runs
    )


@contextmanager
def _quiet() -> Iterator[None]:
    """accelerate warns that the GPUs it is told of are not on this machine, and of fake tensors' data pointers."""
    accelerate_logger = logging.getLogger("accelerate")
    level = accelerate_logger.level
    accelerate_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        accelerate_logger.setLevel(level)
