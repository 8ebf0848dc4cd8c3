"""Model code and what loads it: the Llama-family model, the null model, weight
loaders (HF directory, GGUF, dummy), the default model, tokenizer loading, and the
ForwardBatch a model reads."""
