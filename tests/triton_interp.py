"""Run our Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

Must be imported before anything imports triton.  Five fixes to Triton 3.6's interpreter,
for the test run only:
* with NumPy >= 2.4, int() of the one-element arrays the interpreter keeps scalars in raises,
  so a loop bound computed in the kernel fails (`for t in range(a, b)`); read the element.
* tl.dot on bfloat16 operands multiplies their raw uint16 storage; widen them to float32
  first (bf16 products are exact in float32, so this is what the tensor cores compute).
* tensor descriptors have no atomic add (TMA reduce-add); do it as load + add + store, which
  is what it means for one program at a time.
* a cast down to float8 e4m3 keeps no subnormals and drops the rounding's carry into the
  exponent; round through torch instead (nearest even, saturating, what the GPU's cvt does).
* a cast of float32 down to bfloat16 truncates the mantissa; round to nearest even through torch
  (what the GPU does unless a kernel asks for rtz).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as _ti  # noqa: E402

_patch_tensor = _ti._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


_ti._patch_lang_tensor = _patch_lang_tensor

_create_dot = _ti.InterpreterBuilder.create_dot


def _widen(h):
    if h.dtype.scalar == tl.bfloat16:
        data = _ti._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return _ti.TensorHandle(data, tl.float32)
    return h


def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _create_dot(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)


_ti.InterpreterBuilder.create_dot = _dot


def _descriptor_reduce(self, kind, desc, value, indices):
    assert kind == _ti._ir.DESCRIPTOR_REDUCE_KIND.ADD, kind
    old = self.create_descriptor_load(desc, indices, None, None)
    return self.create_descriptor_store(desc, _ti.TensorHandle(old.data + value.data, value.dtype.scalar), indices)


_ti.InterpreterBuilder.create_descriptor_reduce = _descriptor_reduce


_convert = _ti._convert_float


def _convert_float(input, input_dtype, output_dtype, rounding_mode):
    if output_dtype == tl.float8e4nv and input_dtype.primitive_bitwidth > 8:
        import torch

        x = torch.from_numpy(np.asarray(input).view(getattr(np, f"float{input_dtype.primitive_bitwidth}")).copy())
        x = x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return x.view(torch.uint8).numpy()
    if output_dtype == tl.bfloat16 and input_dtype == tl.float32 and (rounding_mode is None
                                                                    or "rtz" not in str(rounding_mode).lower()):
        import torch

        x = torch.from_numpy(np.asarray(input).view(np.float32).copy()).to(torch.bfloat16)
        return x.view(torch.uint16).numpy()
    return _convert(input, input_dtype, output_dtype, rounding_mode)


_ti._convert_float = _convert_float
