"""EngineConfig's validation and the dtypes it resolves: the adapter slots' lora_dtype."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.lora.slots import slot_buffer_bytes
from loraplex.engine.models.synthetic import synthetic_model
from loraplex.engine.pool import adapter_device_bytes


def test_lora_dtype_auto_is_the_models_and_any_float_dtype_may_sit_under_any_model():
    assert EngineConfig(device="cpu").lora_torch_dtype == torch.float32
    assert EngineConfig(device="cpu", dtype="bfloat16").lora_torch_dtype == torch.bfloat16
    assert EngineConfig(device="cpu", lora_dtype="bfloat16").lora_torch_dtype == torch.bfloat16
    assert EngineConfig(device="cpu", lora_dtype="float16").lora_torch_dtype == torch.float16
    assert EngineConfig(device="cuda").lora_torch_dtype == torch.bfloat16  # the model's dtype on CUDA
    assert EngineConfig(device="cuda", dtype="float32", lora_dtype="float16").lora_torch_dtype == torch.float16


@pytest.mark.parametrize("kwargs,match", [
    (dict(device="cpu", lora_dtype="int8"), "lora_dtype must be auto or one of"),
    (dict(device="cpu", lora_dtype="bf16"), "lora_dtype must be auto or one of"),
    (dict(device="cpu", lora_dtype=None), "lora_dtype must be auto or one of"),
])
def test_bad_lora_dtypes_are_refused_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        EngineConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_memory_accounting_counts_16_bit_slots_at_half_and_the_fp32_folds_in_full():
    """The pool's estimate of a model's adapter memory (pool.adapter_device_bytes): the slot buffers at
    lora_dtype, the folded copies (lora_fold.c packs fp32) and the merged projections at the model's."""
    model = synthetic_model("tiny")[0]
    fp32, bf16 = EngineConfig(device="cpu"), EngineConfig(device="cpu", lora_dtype="bfloat16")
    slots32 = slot_buffer_bytes(model, fp32.max_loras, fp32.max_lora_rank, torch.float32)
    slots16 = slot_buffer_bytes(model, fp32.max_loras, fp32.max_lora_rank, torch.bfloat16)
    assert slots16 < slots32
    cpu = torch.device("cpu")
    assert adapter_device_bytes(fp32, model, cpu) - adapter_device_bytes(bf16, model, cpu) == slots32 - slots16
