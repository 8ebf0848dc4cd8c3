"""The caller-side roles and their plumbing: the tokenizer manager (in the caller's
event loop), the detokenizer and its output router, role launching (child
processes or threads) and an engine's roles as one group, the children's entry
point, the watchdog, request metrics. Imports core, transports and sched (to build
a scheduler role, find the default model, load a tokenizer); never the engines, the
server or the CLI. What the caller's side imports of it imports no torch."""
