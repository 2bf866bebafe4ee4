"""The memory doctor: what survives a step and should not (leaks), what is held past its last use,
and who made it. Core code, no Lightning import; ``MemoryDoctor`` (callbacks) and ``memkit doctor`` wire it.

Import each name from the module that defines it."""
