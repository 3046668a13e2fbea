"""Native CPU kernels, compiled from C++ on first use; callers fall back to torch without them."""

from ladle.model.kernels.small_linear import MAX_ROWS, SmallLinear, small_linear

__all__ = ["MAX_ROWS", "SmallLinear", "small_linear"]
