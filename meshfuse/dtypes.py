"""``DataType``: the element types of fusion values, and their torch equivalents."""

import enum

import torch


class DataType(enum.Enum):
    """Element type of a tensor or scalar, named as in nvFuser's Python frontend.

    ``Null`` is nvFuser's "no dtype given" (``fd.ops.sum(x, dtype=DataType.Null)``); it has no
    torch dtype. A member is callable and returns itself, so that nvFuser's ``tv.dtype()``
    reads the same as meshfuse's ``tv.dtype``.
    """

    Double = torch.float64
    Float = torch.float32
    Half = torch.float16
    BFloat16 = torch.bfloat16
    Int = torch.int64
    Int32 = torch.int32
    UInt64 = torch.uint64
    Bool = torch.bool
    ComplexFloat = torch.complex64
    ComplexDouble = torch.complex128
    Null = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.value

    @staticmethod
    def from_torch(dtype: torch.dtype) -> "DataType":
        for member in DataType:
            if member.value == dtype and member is not DataType.Null:
                return member
        raise TypeError(f"torch dtype {dtype} has no meshfuse DataType")

    @property
    def is_floating(self) -> bool:
        return self.value is not None and self.value.is_floating_point

    @property
    def is_low_precision(self) -> bool:
        """Half and BFloat16: nvFuser computes arithmetic on them in Float."""
        return self in (DataType.Half, DataType.BFloat16)

    def __call__(self) -> "DataType":
        return self

    def __repr__(self) -> str:
        return f"DataType.{self.name}"


def dtype_of_number(value: object) -> DataType | None:
    """The DataType of a Python number as a scalar operand (bool, int, float, complex map to
    Bool, Int, Double, ComplexDouble, as PyTorch treats Python scalars); None for anything
    else."""
    for kind, dtype in ((bool, DataType.Bool), (int, DataType.Int), (float, DataType.Double),
                        (complex, DataType.ComplexDouble)):
        if isinstance(value, kind):
            return dtype
    return None
