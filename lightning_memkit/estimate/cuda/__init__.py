"""The CUDA target of an estimate: its kernel table (kernels), the GPU (gpu_target), calls rewritten as CUDA runs them
(functions, attention, autocast), library workspaces (workspaces) and the caching-allocator model (caching_allocator).
Import each name from its module."""
