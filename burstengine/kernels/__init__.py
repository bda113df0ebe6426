"""Local (single-device) attention kernels behind one interface (base.Kernel), and their
registry (registry.py: the kernels by name, the automatic choice, :func:`get_kernel`)."""
from .base import Kernel, acc_dtype
from .registry import AUTO_TABLE, CARDS, KERNELS, AutoKernel, get_kernel

__all__ = ["AutoKernel", "AUTO_TABLE", "CARDS", "Kernel", "KERNELS", "acc_dtype", "get_kernel"]
