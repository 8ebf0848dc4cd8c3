"""CURVE key material for the tcp transport: key pairs, a server's key folder, and
zmq.auth's certificate files (`NAME.key` holds a public key, `NAME.key_secret`
the pair).

A server's folder (`sgl keys new DIR`) holds `server.key` / `server.key_secret`,
`allowed/` (public keys of the clients it accepts) and optionally `admin/` (public
keys of clients that may also shut it down or flush its cache). Either of
`allowed` and `admin` may instead be a text file of z85 public keys, one a line
(`#` starts a comment). Admin keys are allowed keys too.

It reads and writes keys only: it opens no socket and knows nothing of messages or
of what an admin may do (sgl.runtime.identity decides that)."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import zmq
from zmq.auth.certs import create_certificates, load_certificate
from zmq.utils import z85

from sgl.core.log import get_logger

log = get_logger("transport")

KEY_CHARS = 40  # a 32-byte Curve25519 key in z85
SERVER_NAME = "server"
HOW_TO_MAKE_KEYS = ("make a key folder with `sgl keys new DIR`, add each client with "
                    "`sgl keys new DIR --name NAME`, and start the server with `--transport-keys DIR`")


class KeyFileError(ValueError):
    """A key file or folder that is missing, unreadable or malformed."""


class KeyPair(msgspec.Struct, frozen=True):
    public: str  # z85
    secret: str  # z85: never logged, never reported


class KeySet(msgspec.Struct, frozen=True):
    """What a server needs: its own pair and the client keys it accepts."""

    server: KeyPair
    clients: tuple[str, ...] = ()  # allowed client public keys (z85)
    admins: tuple[str, ...] = ()  # admin client public keys (z85), allowed as well

    def allowed(self) -> frozenset[str]:
        """Every public key that may connect to the server's scheduler: its own roles' and its clients'."""
        return frozenset((self.server.public, *self.clients, *self.admins))


def check_key(key: str, what: str) -> str:
    if len(key) != KEY_CHARS:
        raise KeyFileError(f"{what}: a CURVE key is {KEY_CHARS} z85 characters, got {len(key)}")
    try:
        if len(z85.decode(key)) != 32:
            raise ValueError
    except ValueError:
        raise KeyFileError(f"{what}: not a z85-encoded 32-byte key") from None
    return key


def new_pair() -> KeyPair:
    public, secret = zmq.curve_keypair()
    return KeyPair(public.decode("ascii"), secret.decode("ascii"))


def ephemeral_keyset() -> KeySet:
    """A key set for one engine's own roles, made at start and never written to disk."""
    return KeySet(new_pair())


def write_pair(folder: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret (readable by the owner only) in `folder`; refuses
    to overwrite a pair already there. Returns (public path, secret path)."""
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(f"name={name!r} is invalid: must be a plain file name")
    if (d / f"{name}.key_secret").exists() or (d / f"{name}.key").exists():
        raise KeyFileError(f"{d / name}.key already exists: pick another --name or remove it first")
    old = os.umask(0o077)
    try:
        pub, sec = create_certificates(d, name)
    finally:
        os.umask(old)
    os.chmod(sec, 0o600)
    os.chmod(pub, 0o644)
    return Path(pub), Path(sec)


def load_pair(path: str | os.PathLike[str]) -> KeyPair:
    """The pair in a NAME.key_secret certificate."""
    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyFileError(f"cannot read the key pair {path}: {e}") from None
    if secret is None:
        raise KeyFileError(f"{path} holds no secret key: give the NAME.key_secret file, not NAME.key")
    p = Path(path)
    if p.stat().st_mode & 0o077:
        log.warning("a secret key file is readable by others", path=str(p), fix=f"chmod 600 {p}")
    return KeyPair(check_key(public.decode("ascii"), str(path)), check_key(secret.decode("ascii"), str(path)))


def load_public(key_or_path: str | os.PathLike[str]) -> str:
    """A public key given as its z85 text or as a certificate file (NAME.key)."""
    s = os.fspath(key_or_path)
    if len(s) == KEY_CHARS and not os.path.exists(s):
        return check_key(s, "public key")
    try:
        public, _ = load_certificate(s)
    except (OSError, ValueError) as e:
        raise KeyFileError(f"cannot read the public key {s}: {e}") from None
    return check_key(public.decode("ascii"), s)


def _public_keys(path: Path) -> tuple[str, ...]:
    """The keys of a folder of *.key certificates or of a file of z85 keys; () if absent."""
    if path.is_dir():
        return tuple(sorted(load_public(f) for f in path.glob("*.key")))
    if path.is_file():
        keys = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            text = line.split("#", 1)[0].strip()
            if text:
                keys.append(check_key(text.split()[0], f"{path}:{n}"))
        return tuple(keys)
    return ()


def load_key_dir(folder: str | os.PathLike[str]) -> KeySet:
    d = Path(folder)
    secret = d / f"{SERVER_NAME}.key_secret"
    if not d.is_dir() or not secret.is_file():
        raise KeyFileError(f"transport_keys={os.fspath(folder)!r} is invalid: no {SERVER_NAME}.key_secret there "
                        f"({HOW_TO_MAKE_KEYS})")
    keys = KeySet(load_pair(secret), _public_keys(d / "allowed"), _public_keys(d / "admin"))
    if not keys.clients and not keys.admins:
        log.warning("no client keys: nothing outside this engine can attach", folder=str(d),
                    fix="sgl keys new DIR --name NAME")
    return keys
