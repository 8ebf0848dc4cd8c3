"""The wire between roles: one codec (MessagePack via msgspec, tagged union) and
one-directional typed channels over in-process queues or ZMQ (ipc, tcp).
Imports only sgl's protocol data; knows nothing of what the roles do."""
