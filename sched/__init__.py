"""The scheduler role: request state, batching, the model runner, the sampler and
model code. Imports the bottom of sgl, transports, cache and kernels; never the
caller-side roles."""
