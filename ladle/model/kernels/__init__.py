"""Native CPU kernels, compiled from C++ on first use; callers fall back to torch without them."""

from ladle.model.kernels.loader import MAX_ROWS, native_kernels
from ladle.model.kernels.native import NativeKernels

__all__ = ["MAX_ROWS", "NativeKernels", "native_kernels"]
