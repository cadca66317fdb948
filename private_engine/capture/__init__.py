"""Capture: what per-sample clipping needs from a forward and backward — each ruled layer's input
activations and output gradients (:mod:`.recorder`), the per-sample gradients of parameters used
outside a ruled layer (:mod:`.tracer`) and of modules clipped by ``torch.func`` (:mod:`.fallback`).
"""
