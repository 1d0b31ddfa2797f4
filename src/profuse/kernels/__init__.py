"""Hand-written Triton kernels. Import `profuse.kernels.tail` only where triton is installed."""

try:
    import triton  # noqa: F401

    HAS_TRITON = True
    TRITON_MISSING = ""
except ImportError:  # a CPU machine without the optional dependency
    HAS_TRITON = False
    TRITON_MISSING = "triton is not installed (pip install triton, or pip install 'profuse[triton]')"
