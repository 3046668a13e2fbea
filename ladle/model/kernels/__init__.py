"""Native CPU kernels, compiled from C++ on first use; callers fall back to torch without them."""

from ladle.model.kernels.loader import native_kernels
from ladle.model.kernels.native import NativeKernels

__all__ = ["NativeKernels", "native_kernels"]
