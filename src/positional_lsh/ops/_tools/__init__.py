"""Developer tooling of the Triton kernels, not used at run time: ahead-of-time compile checks and the work model."""
