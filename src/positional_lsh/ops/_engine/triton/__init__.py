"""The multiplicity form as Triton kernels (the GPU path): the host code, the per-call plan and the kernels.

``triton`` is optional: nothing here is imported unless a call takes the Triton route.
"""
