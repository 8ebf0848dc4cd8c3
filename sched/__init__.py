"""The scheduler role: the loop, admission (the prefill adder), decode and
retraction, result processing, request and batch state, policies; model execution
in runner/ and model code in models/. Imports sgl.core, transports, cache and
kernels; never the caller-side roles."""
