"""The NVMe Computational Programs and Subsystem Local Memory command sets: compute and memory namespaces, adamw_step as a built-in program, SLM I/O."""
