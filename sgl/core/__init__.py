"""The bottom of sgl: the typed data every layer shares (the wire messages, sampling
parameters, server arguments) and the few helpers beside it that any layer may use
(logging, the logit-processor registry, request value checks). Imports nothing of
sgl outside this package."""
