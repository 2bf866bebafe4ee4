"""Fake tensors for the estimate: what a fake is (tensors), one fake world (session), a fake step's ops (step_ops),
outputs as the real kernels give them (outputs), values known without data (known_values, value_sets), data-dependent
shapes (data_dependent_ops) and the fake copy a step runs on (copies). Import each name from its module."""
