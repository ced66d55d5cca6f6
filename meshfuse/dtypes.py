"""``DataType``: the element types of fusion values, and their torch equivalents."""

import enum

import torch


class DataType(enum.Enum):
    """Element type of a tensor or scalar, named as in nvFuser's Python frontend."""

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

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.value

    @staticmethod
    def from_torch(dtype: torch.dtype) -> "DataType":
        for member in DataType:
            if member.value == dtype:
                return member
        raise TypeError(f"torch dtype {dtype} has no meshfuse DataType")

    @property
    def is_floating(self) -> bool:
        return self.value.is_floating_point

    def __repr__(self) -> str:
        return f"DataType.{self.name}"
