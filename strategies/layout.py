"""A parallel layout: how many GPUs, how they split the model (tensor parallel) and the data (data parallel,
with a ZeRO stage), and whose runtime is modelled."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from transformers import PretrainedConfig

from strategies.tensor_parallel import COLWISE, ROWWISE
from tracer.errors import UserError

ENGINES = ("fsdp", "deepspeed")
TP_OUTPUTS = ("parallel", "gathered")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOADS = ("optimizer", "optimizer,params")


@dataclass(frozen=True)
class Layout:
    """``gpus`` = ``tp`` x data-parallel degree. ``zero`` is the ZeRO stage over the data-parallel group (0 is
    plain DDP). ``engine`` picks whose runtime is modelled: PyTorch (DDP for 0, DDP with
    ZeroRedundancyOptimizer for 1, FSDP2 for 2 and 3) or DeepSpeed."""

    gpus: int = 1
    tp: int = 1
    zero: int = 0
    engine: str = "fsdp"
    sequence_parallel: bool = False
    tp_output: str = "parallel"
    offload: str | None = None  # what lives in host memory: the optimizer step, or that and the parameters

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise UserError(f"--gpus must be at least 1 (got {self.gpus}).")
        if self.tp < 1:
            raise UserError(f"--tp must be at least 1 (got {self.tp}).")
        if self.gpus % self.tp:
            raise UserError(f"--tp {self.tp} must divide --gpus {self.gpus} (the data-parallel degree is gpus / tp).")
        if self.zero not in ZERO_STAGES:
            raise UserError(f"--zero must be 0, 1, 2 or 3 (got {self.zero}).")
        if self.engine not in ENGINES:
            raise UserError(f"--engine must be fsdp or deepspeed (got {self.engine!r}).")
        if self.tp_output not in TP_OUTPUTS:
            raise UserError(f"--tp-output must be parallel or gathered (got {self.tp_output!r}).")
        if self.offload is not None:
            self._check_offload()
        if self.zero and self.dp == 1 and not (self.offload and self.engine == "deepspeed"):
            raise UserError(
                f"--zero {self.zero} shards over the data-parallel group, which is a single GPU with --gpus "
                f"{self.gpus} --tp {self.tp}. Use more GPUs or --zero 0."
            )
        if self.engine == "deepspeed" and self.zero == 0 and self.dp > 1:
            raise UserError(
                "DeepSpeed without ZeRO is not modelled: use --engine deepspeed --zero 1, 2 or 3, or plain "
                "PyTorch DDP with --engine fsdp --zero 0."
            )
        if self.tp == 1 and (self.sequence_parallel or self.tp_output != "parallel"):
            raise UserError("--sequence-parallel and --tp-output apply to tensor parallelism: add --tp 2 or more.")

    def _check_offload(self) -> None:
        if self.offload not in OFFLOADS:
            raise UserError(f"--offload must be optimizer or optimizer,params (got {self.offload!r}).")
        if self.engine == "deepspeed":
            if self.zero == 0:
                raise UserError("DeepSpeed offloads with ZeRO: add --zero 1, 2 or 3 (ZeRO-Offload).")
            if self.offload == "optimizer,params" and self.zero != 3:
                raise UserError("DeepSpeed offloads parameters with ZeRO-3 only: use --zero 3.")
            return
        if self.zero != 3 or self.offload != "optimizer,params":
            raise UserError(
                "PyTorch offloads with FSDP2's CPUOffloadPolicy, which moves the parameters, gradients and "
                "optimizer step to the host: use --zero 3 --offload optimizer,params, or --engine deepspeed."
            )

    @property
    def dp(self) -> int:
        return self.gpus // self.tp

    @property
    def plain(self) -> bool:
        """One GPU, no ZeRO: the traced step as it is."""
        return self.gpus == 1 and not self.zero

    def check_model(self, config: PretrainedConfig) -> None:
        """Refuse layouts the model cannot be split into."""
        if self.tp == 1:
            return
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % self.tp:
            raise UserError(f"--tp {self.tp} must divide the {heads} attention heads of this model.")
        if kv_heads % self.tp:
            raise UserError(f"--tp {self.tp} must divide the {kv_heads} key/value heads of this model.")
        plan = getattr(config, "base_model_tp_plan", None) or {}
        name = type(config).__name__.removesuffix("Config")
        if not plan:
            raise UserError(
                f"--tp needs the model's tensor-parallel plan, and transformers defines none for {name}. "
                "Tensor parallelism is modelled for models that have one (Llama, Mistral, Qwen2, Gemma-2, "
                "GPT-NeoX/Pythia); use --tp 1."
            )
        unsupported = sorted({style for style in plan.values() if style not in (COLWISE, ROWWISE)})
        if unsupported:
            raise UserError(
                f"--tp: {name}'s tensor-parallel plan uses {', '.join(unsupported)}, which is not modelled "
                "(only colwise and rowwise layers are); use --tp 1."
            )

    def describe(self) -> str:
        offload = f", {self.offload.replace(',', ' and ')} offloaded to the CPU" if self.offload else ""
        if self.plain:
            return "1 GPU"
        parts = []
        if self.tp > 1:
            sequence = " with sequence parallelism" if self.sequence_parallel else ""
            gathered = ", gathered logits" if self.tp_output == "gathered" else ""
            parts.append(f"tensor parallel {self.tp}{sequence}{gathered}")
        if self.dp > 1:
            parts.append(f"{self.data_parallel_name()} over {self.dp}")
        elif self.zero:
            parts.append(self.data_parallel_name())
        return f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}: " + " x ".join(parts) + offload

    def data_parallel_name(self) -> str:
        if self.zero == 0:
            return "DDP" if self.engine == "fsdp" else "DeepSpeed data parallel"
        if self.engine == "fsdp" and self.zero == 1:
            return "DDP with ZeroRedundancyOptimizer"
        if self.engine == "fsdp":
            return "FSDP2" if self.zero == 3 else "FSDP2 (reshard_after_forward=False)"
        return f"DeepSpeed ZeRO-{self.zero}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"dp": self.dp}
