"""Model execution, apart from scheduling: the model runner (a ScheduleBatch in,
sampled ids and logprobs out), batch preparation, CUDA graphs and the sampler. It
decides nothing about which requests run, and imports nothing of the scheduling
modules beside it (scheduler, admission, retraction, results)."""
