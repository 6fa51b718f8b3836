"""Kernels behind one dispatch point; see :mod:`sparsecomm.ops.dispatch`."""
from sparsecomm.ops.dispatch import implementation, register_kernel, select_and_pack, unpack_add

__all__ = ["implementation", "register_kernel", "select_and_pack", "unpack_add"]
