"""``--recipe``: what each framework's own training step does where it changes memory, as the flags' defaults
(a ``--config`` file and the flags given win), with the source lines each default follows and what the
framework does that the estimate does not model.

Versions read: transformers 5.23 (its wheel), accelerate 1.15, TRL 1.16, torchtune bd2a0fc, torchtitan
b5bcd76, AnswerDotAI/fsdp_qlora 05ed9f2, axolotl 067b021. ``dtype: "checkpoint"`` is the dtype the checkpoint
is stored in, which ``from_pretrained`` loads by default since transformers 5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from analysis.run_config import as_flag


@dataclass(frozen=True)
class Recipe:
    name: str
    what: str
    defaults: dict[str, Any]
    sources: tuple[str, ...]  # where each default comes from
    not_modelled: tuple[str, ...] = ()  # what the framework does that the estimate leaves out, and which way

    def summary(self) -> list[str]:
        flags = " ".join(as_flag(dest, value) for dest, value in self.defaults.items())
        lines = [f"--recipe {self.name} ({self.what}): {flags}"]
        lines += [f"  from {source}" for source in self.sources]
        lines += [f"  not modelled: {item}" for item in self.not_modelled]
        return lines


RECIPES = {
    recipe.name: recipe
    for recipe in (
        Recipe(
            "trainer",
            "the Hugging Face Trainer, transformers 5.23",
            {
                "dtype": "checkpoint",
                "mixed_precision": "bf16",
                "accelerate_prepared": True,
                "use_cache": "off",
                "optimizer": "adamw",
                "optimizer_impl": "fused",
            },
            (
                "modeling_utils.py:4177-4178, 829-832: from_pretrained loads the checkpoint's dtype (dtype='auto')",
                "trainer.py:645-646: model.config.use_cache = args.use_cache, False by default "
                "(training_args.py:971-976): no key/value cache in the training forward",
                "training_args.py:806-814: optim adamw_torch_fused on torch >= 2.8",
                "trainer.py:2209, 2084: compute_loss returns the loss only and the outputs are dropped before backward",
                "modeling_utils.py:3148-3149: gradient checkpointing, when on, is use_reentrant=False",
                "trainer.py:1946: model.zero_grad() sets gradients to None",
                "accelerate accelerator.py:1818-1829: under mixed precision the forward's outputs are copied to fp32",
            ),
        ),
        Recipe(
            "trl-sft",
            "TRL's SFTTrainer, TRL 1.16",
            {
                "dtype": "fp32",
                "mixed_precision": "bf16",
                "grad_checkpointing": "full",
                "seq_len": 1024,
                "use_cache": "off",
                "optimizer": "adamw",
                "optimizer_impl": "fused",
            },
            (
                "trainer/utils.py:1332-1336: a model given by name loads in float32 unless model_init_kwargs names "
                "a dtype",
                "transformers trainer.py:645-646: the Trainer under SFTTrainer sets model.config.use_cache from "
                "use_cache, False by default",
                "trainer/base_config.py:62-63, 108: gradient_checkpointing and bf16 default to true",
                "sft_config.py:202-203: max_length 1024",
                "sft_trainer.py:1079-1081 with transformers 5: checkpointing is use_reentrant=False",
            ),
            (
                "the default loss (loss_type nll) runs a fused, tiled lm_head kernel that never makes the full logits "
                "(sft_trainer.py:1142-1147, kernels/chunked_logprob.py): the estimate holds the full logits and "
                "transformers' loss, an upper bound where the logits dominate",
            ),
        ),
        Recipe(
            "accelerate-loop",
            "the loop of accelerate's examples",
            {
                "dtype": "checkpoint",
                "mixed_precision": "bf16",
                "accelerate_prepared": True,
                "keep_outputs": True,
                "optimizer": "adamw",
            },
            (
                "examples/nlp_example.py:163-170: outputs = model(**batch); loss = outputs.loss; "
                "accelerator.backward(loss): the outputs live until the next forward returns",
                "nlp_example.py:140: torch.optim.AdamW with torch's defaults",
                "accelerate optimizer.py:112-118: zero_grad sets gradients to None",
                "accelerator.py:1818-1829, operations.py:889-910: under mixed precision the outputs, kept logits "
                "included, are fp32 copies",
            ),
        ),
        Recipe(
            "torchtune",
            "torchtune's single-device and distributed recipes",
            {
                "dtype": "bf16",
                "mixed_precision": "off",
                "grad_checkpointing": "full",
                "optimizer": "adamw",
                "optimizer_impl": "fused",
            },
            (
                "lora_finetune_single_device.py:80-85, 410: the whole model, gradients and optimizer in dtype bf16",
                "training/memory.py:26-43: activation checkpointing per layer, non-reentrant",
                "lora_finetune_single_device.py:599-600: del outputs before backward",
                "configs, e.g. 8B_lora_single_device.yaml:61-63: torch.optim.AdamW(fused=True)",
            ),
            (
                "torchtune's own model code (estimated with transformers' model of the same config)",
                "LinearCrossEntropyLoss computes the loss in 8 chunks without the full logits "
                "(modules/loss/cross_entropy_loss.py): an upper bound where the logits dominate",
            ),
        ),
        Recipe(
            "torchtitan",
            "torchtitan's trainer with FSDP2",
            {
                "dtype": "fp32",
                "mixed_precision": "bf16",
                "grad_checkpointing": "op",
                "optimizer": "adamw",
                "optimizer_impl": "fused",
            },
            (
                "configs.py:87, 94, 102: fp32 parameters, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
                "trainer.py:108-110, activation_checkpoint.py:31-94, 241-274: selective checkpointing per op by "
                "default (the 70B config uses full: --grad-checkpointing full)",
                "trainer.py:795-799: del pred before backward",
                "components/optimizer.py:109-111, 152-165: AdamW, implementation fused",
            ),
            (
                "torchtitan's own model code (estimated with transformers' model of the same config)",
                "CUDA graphs, on by default, zero gradients in place (trainer.py:845): gradients stay allocated "
                "across steps, which the estimate frees",
                "the Llama 3 configs' chunked loss (components/loss.py:544, 627-699)",
            ),
        ),
        Recipe(
            "fsdp-qlora",
            "Answer.AI's fsdp_qlora train.py",
            {
                "dtype": "bf16",
                "grad_checkpointing": "full",
                "reentrant": True,
                "keep_outputs": True,
                "optimizer": "adamw",
            },
            (
                "train.py:536-539, 823-826: precision bf16 is the whole model in bf16, no autocast",
                "train.py:778-792 and benchmarks_03_2024.md:25: checkpoint_wrapper per decoder layer, run with "
                "--reentrant_checkpointing True",
                "train.py:871-877, 894, 923-926: output is kept until after the optimizer step",
                "train.py:458-460: torch.optim.AdamW(fused=False)",
                "train.py:1058-1061: --train_type qlora trains rank-64 adapters on q, k, v, gate, up and down: add "
                "--qlora --lora-r 64 --lora-targets q_proj,k_proj,v_proj,gate_proj,up_proj,down_proj (--lora-r 64 ... "
                "for --train_type lora)",
            ),
            (
                "FSDP1's FlatParameter over Linear4bit(quant_storage=bf16) (train.py:615-616, 740-766), estimated with "
                "FSDP2's per-parameter shards of the same packed bytes: give --gpus N --zero 3",
                "train.py offloads to the CPU by default (:1050): add --offload optimizer,params to match",
                "whether the adapters train in bf16 depends on the peft version; the estimate keeps peft's fp32 ones",
            ),
        ),
        Recipe(
            "axolotl",
            "axolotl's SFT trainer",
            {"dtype": "bf16", "use_cache": "off", "optimizer": "adamw", "optimizer_impl": "fused"},
            (
                "utils/config/__init__.py:190-197, loaders/model.py:611-612: the model loads in bf16 when bf16 is on",
                "transformers trainer.py:645-646: the HF Trainer it runs sets model.config.use_cache from use_cache, "
                "False by default",
                "utils/config/__init__.py:377-383: gradient checkpointing, when on, is use_reentrant=True unless its "
                "kwargs say otherwise (add --grad-checkpointing --reentrant, or read the run's YAML with --config)",
                "schemas/training.py:122-124: optimizer adamw_torch_fused",
                "loaders/model.py:456-478: after prepare_model_for_kbit_training, norms and embeddings go back to bf16",
            ),
        ),
    )
}
