#!/usr/bin/env python3
"""Writes tests/assets/safetensors/py_written.safetensors with Python's safetensors library.

tests/io/test_safetensors.cpp reads the file and checks these exact values, which proves that our
reader agrees with the reference writer (header layout, padding, dtype names, byte order, the
library's own ordering of tensors by dtype alignment). Re-run only if the test changes:
    /work/pyenv/bin/python tools/make_safetensors_fixture.py
"""
import os

import torch
from safetensors.torch import save_file

here = os.path.dirname(os.path.abspath(__file__))
out = os.path.join(here, "..", "tests", "assets", "safetensors", "py_written.safetensors")

tensors = {
    # f32 [2, 3]: 0.5 * i - 1
    "weight.f32": (torch.arange(6, dtype=torch.float32) * 0.5 - 1.0).reshape(2, 3),
    # bf16 [4]: values exactly representable in bf16
    "weight.bf16": torch.tensor([1.0, -2.5, 3.140625, 65280.0], dtype=torch.bfloat16),
    # f16 [2, 2]: includes the largest finite f16 and a subnormal (2^-24)
    "weight.f16": torch.tensor([[0.333251953125, -65504.0], [2.0**-24, 7.0]], dtype=torch.float16),
    # i64 [3]: includes a value that needs more than 32 bits
    "steps.i64": torch.tensor([0, -7, 1 << 40], dtype=torch.int64),
}
save_file(tensors, out, metadata={"format": "pt", "made_by": "tools/make_safetensors_fixture.py"})
print(out, os.path.getsize(out), "bytes")
