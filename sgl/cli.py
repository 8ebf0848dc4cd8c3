"""The `sgl` command line. `sgl generate "PROMPT"` runs one request on an engine
and prints the answer (the chat template applied when the model has one);
`sgl serve [MODEL] [FLAGS]` runs the HTTP server, its flags generated from ServerArgs;
`sgl keys new DIR [--name NAME] [--admin]` writes CURVE keys for the tcp transport."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sgl.cli_args import add_server_args, server_args_from
from sgl.core.server_args import ServerArgs
from sgl.core.version import __version__

CLI_ADAPTER = "adapter"  # the name `sgl generate --lora-path` loads its adapter under


def _generate(ns: argparse.Namespace) -> int:
    from sgl.core.log import configure_logging
    from sgl.engine import Engine

    configure_logging(ns.log_level)
    if ns.stream and ns.beam_width:
        raise ValueError("--stream: a beam search (--beam-width) never streams")
    kwargs: dict[str, Any] = {"transport": ns.transport, "log_level": ns.log_level}
    if ns.load_format:
        kwargs["load_format"] = ns.load_format
    if ns.dtype:
        kwargs["dtype"] = ns.dtype
    if ns.chat_template:
        kwargs["chat_template"] = ns.chat_template
    adapter = None
    if ns.lora_path:
        kwargs["lora_paths"] = [f"{CLI_ADAPTER}={ns.lora_path}"]
        adapter = CLI_ADAPTER
    with Engine(ns.model_path, **kwargs) as engine:
        prompt = ns.prompt
        tok = engine.tokenizer
        if not ns.raw and tok is not None and getattr(tok, "chat_template", None):
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        params: dict[str, Any] = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature}
        if ns.beam_width:
            params["beam_width"] = ns.beam_width
            for beam in engine.generate(prompt, params, lora_path=adapter):  # best first
                print(f"[{beam['meta_info']['beam_index']}] score={beam['meta_info']['score']}: {beam['text']}")
        elif ns.stream:
            for chunk in engine.generate(prompt, params, stream=True, lora_path=adapter):
                sys.stdout.write(chunk["text"])
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            print(engine.generate(prompt, params, lora_path=adapter)["text"])
    return 0


def _keys_new(ns: argparse.Namespace) -> int:
    """The server's pair (no --name) with empty allowed/ and admin/ folders, or a client's
    pair, whose public key is also put in DIR/allowed/ (DIR/admin/ with --admin) when
    DIR is a server's key folder."""
    from pathlib import Path

    from sgl.transports.keys import SERVER_NAME, write_pair

    d = Path(ns.dir)
    name = ns.name or SERVER_NAME
    if name == SERVER_NAME and ns.admin:
        raise ValueError("--admin is for a client's key: give it a --name")
    public, secret = write_pair(d, name)
    if name == SERVER_NAME:
        for sub in ("allowed", "admin"):
            (d / sub).mkdir(exist_ok=True)
        print(f"server keys: {secret} (keep it here), {public} (give it to clients)")
        print(f"add a client: sgl keys new {d} --name NAME [--admin]; serve: sgl serve --transport tcp "
              f"--transport-keys {d}")
        return 0
    print(f"client keys for {name!r}: {secret} (give it, with the server's server.key, to that client only)")
    if (d / f"{SERVER_NAME}.key_secret").is_file():
        folder = d / ("admin" if ns.admin else "allowed")
        folder.mkdir(exist_ok=True)
        (folder / public.name).write_bytes(public.read_bytes())
        print(f"allowed on this server: {folder / public.name} (restart the server to pick it up)")
    else:
        print(f"to allow it, copy {public} into the server's DIR/{'admin' if ns.admin else 'allowed'}/")
    server_key = str(d / f"{SERVER_NAME}.key")
    print(f"attach: await sgl.AsyncEngine.connect(ADDRESS, keys={str(secret)!r}, server_key={server_key!r})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sgl", description="sgl: a compact LLM serving engine")
    p.add_argument("--version", action="version", version=f"sgl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("prompt", help="the prompt (the chat template is applied unless --raw)")
    g.add_argument(
        "--model-path", default=None, help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    g.add_argument("--max-new-tokens", type=int, default=128, help="the most tokens to generate (default: 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    g.add_argument("--transport", choices=["inproc", "ipc", "tcp"], default="ipc",
                   help="how the engine's roles talk (default: ipc)")
    g.add_argument("--stream", action="store_true", help="print the text as it is generated")
    g.add_argument("--beam-width", type=int, default=0, help="beam search: print every beam, best first")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--load-format", choices=["auto", "safetensors", "gguf", "dummy", "null"], default=None,
                   help="how to read the weights (default: by the path)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help="weight dtype (default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, instead of the tokenizer's")
    g.add_argument("--lora-path", default=None,
                   help="a LoRA adapter (PEFT folder) of the model: the answer comes from the model with it")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="warning",
                   help="log level (default: warning)")
    g.set_defaults(func=_generate)
    s = sub.add_parser("serve", help="serve the model over HTTP (OpenAI-compatible and SGLang's native API)")
    s.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve (the same as --model-path; put it before list flags)")
    add_server_args(s)
    s.set_defaults(func=_serve)
    k = sub.add_parser("keys", help="CURVE keys for the tcp transport")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    kn = ksub.add_parser("new", help="write a key pair: the server's (no --name) or a client's")
    kn.add_argument("dir", help="the server's key folder (what --transport-keys takes)")
    kn.add_argument("--name", default=None, help="a client's name: writes DIR/NAME.key(_secret) and allows it")
    kn.add_argument("--admin", action="store_true", help="the client may shut the server down and flush its cache")
    kn.set_defaults(func=_keys_new)
    return p


def serve_args(ns: argparse.Namespace) -> ServerArgs:
    """The ServerArgs of `sgl serve [MODEL] [FLAGS]`: MODEL is --model-path."""
    if ns.model is None:
        return server_args_from(ns)
    if getattr(ns, "model_path", None) not in (None, ns.model):
        raise ValueError(f"two models given: MODEL {ns.model!r} and --model-path {ns.model_path!r}")
    return server_args_from(ns, model_path=ns.model)


def _serve(ns: argparse.Namespace) -> int:
    from sgl.server.serve import serve

    return serve(serve_args(ns))


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"sgl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
