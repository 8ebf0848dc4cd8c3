"""The HTTP server: the ASGI app, SGLang's native routes and the OpenAI-compatible
routes, what they share (errors, bodies, server-sent events), and `serve`, which runs
an AsyncEngine and uvicorn on one loop. Imports the engines below it; never the CLI."""
