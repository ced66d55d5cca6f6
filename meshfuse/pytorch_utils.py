"""``meshfuse.pytorch_utils``: nvFuser's ``nvfuser_direct.pytorch_utils`` conversions.

``torch_dtype_to_nvfuser_dtype(torch.bfloat16)`` is ``DataType.BFloat16``; Python number types
map to the dtype of a Python scalar of that type (``float`` -> ``DataType.Double``).
"""

from __future__ import annotations

import torch

from meshfuse.dtypes import DataType

NumberType = type[bool] | type[int] | type[float] | type[complex]

_PYTHON_TYPES = {
    bool: DataType.Bool,
    int: DataType.Int,
    float: DataType.Double,
    complex: DataType.ComplexDouble,
}


def torch_dtype_to_nvfuser_dtype(dtype: torch.dtype | NumberType) -> DataType:
    """The DataType of a torch dtype or of a Python number type.

    Raises:
        TypeError: for a dtype meshfuse has no DataType for (e.g. float8).
    """
    if dtype in _PYTHON_TYPES:
        return _PYTHON_TYPES[dtype]
    return DataType.from_torch(dtype)


def python_scalar_to_nvfuser_dtype(value: complex) -> DataType:
    """The DataType of a Python number: ``python_scalar_to_nvfuser_dtype(1.0)`` is Double."""
    return _PYTHON_TYPES[type(value)]


def nvfuser_dtype_to_torch_dtype(dtype: DataType) -> torch.dtype:
    """The torch dtype of a DataType (``DataType.Null`` has none: TypeError)."""
    if dtype.torch_dtype is None:
        raise TypeError(f"{dtype!r} has no torch dtype")
    return dtype.torch_dtype
