"""Hand-written CPU kernels, JIT-built with torch.utils.cpp_extension on first use."""
