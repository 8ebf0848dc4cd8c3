"""KV-cache memory: the request-to-token table, the KV slot allocator, the KV pools
(their sizing, construction and writes), the radix prefix cache, and pinned
host-to-device copies. Imports nothing of the rest of sgl."""
