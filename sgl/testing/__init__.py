"""sgl.testing: a kit for testing apps that embed sgl, without a GPU or weights.

Everything here that does not start a real engine imports neither torch nor
transformers. The pieces: a fake engine with the engine's public surface and its
rules, a real engine on the public null model that starts in about a second, faults
on demand, Hypothesis strategies for requests, the engine's contract as a checker,
and a pytest plugin with fixtures for all of them (docs/testing.md)."""
