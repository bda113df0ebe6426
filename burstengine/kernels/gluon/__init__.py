"""Gluon kernels for Hopper (warp-specialised forward, TMA reduce-add backward), run by
``kernels.triton.kernel.TritonKernel`` where they take the block.  They import triton's Gluon
API, so they are imported only when they may run."""
