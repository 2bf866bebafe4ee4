"""Exact tensor accounting: the live storages a step makes and frees (``TensorAccountant``), what each
is (parameters, gradients, optimizer state, activations, temporaries: ``CategoryAttributor``), and the
process-wide count of every live tensor (``ProcessTensors``); ``storage_resize`` follows storages resized
outside the dispatcher (FSDP2)."""
