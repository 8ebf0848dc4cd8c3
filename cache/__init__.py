"""KV-cache memory: the request-to-token table, the KV slot allocator, the KV pools
and (later) the radix prefix cache. Imports nothing of the rest of sgl."""
