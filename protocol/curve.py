"""ZeroMQ CURVE keys for engine sockets reached over tcp://, and the `tandem keygen` subcommand.

An engine core on another host listens on tcp://; there the socket must authenticate its clients
and encrypt what crosses the network, which ZMQ's CURVE mechanism (CurveZMQ: Curve25519 keys,
per-connection session keys) does. The roles:

- the engine holds a key pair (``--curve-secret-key engine.key_secret``) and a directory of the
  public keys of the clients it lets in (``--curve-authorized-keys DIR``); a ZAP handler
  (``zmq.auth.thread.ThreadAuthenticator``) checks each connecting client's key against it;
- each client (the frontend, ``tandem client``, scripts) holds its own key pair and the engine's
  public key (``--curve-secret-key client.key_secret --curve-server-key engine.key``).

A client with a key the engine does not list, or one that expects another engine's key, never
completes the CURVE handshake: ZMQ drops the connection and the client's HELLO never gets a
READY, so ``connect()`` times out. Key files are the ZMQ certificate format written by
``zmq.auth.create_certificates``; secret files must not be readable by group or others.

    tandem keygen --dir keys --name engine     # keys/engine.key, keys/engine.key_secret
    tandem keygen --dir keys --name frontend   # copy keys/frontend.key into the engine's DIR
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


@dataclass(frozen=True)
class CurveServerKeys:
    """The engine's key pair and the directory of client public keys it accepts."""

    public: bytes
    secret: bytes
    authorized_dir: Path


@dataclass(frozen=True)
class CurveClientKeys:
    """A client's key pair and the public key of the engine it expects."""

    public: bytes
    secret: bytes
    server_public: bytes


def load_server_keys(
    secret_file: str | os.PathLike, authorized_dir: str | os.PathLike
) -> CurveServerKeys:
    """Read an engine's keys; ValueError with a message fit for the command line if unusable."""
    public, secret = load_key_pair(secret_file)
    directory = Path(authorized_dir)
    if not directory.is_dir():
        raise ValueError(f"--curve-authorized-keys {directory}: not a directory")
    if not any(directory.glob(f"*{PUBLIC_SUFFIX}")):
        logger.warning("no *%s files in %s: no client will be let in", PUBLIC_SUFFIX, directory)
    return CurveServerKeys(public, secret, directory)


def load_client_keys(
    secret_file: str | os.PathLike, server_key_file: str | os.PathLike
) -> CurveClientKeys:
    """Read a client's key pair and the engine's public key."""
    import zmq.auth

    public, secret = load_key_pair(secret_file)
    server_public, _ = _load(zmq.auth.load_certificate, server_key_file)
    return CurveClientKeys(public, secret, server_public)


def load_key_pair(secret_file: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` certificate that only its owner can read."""
    import zmq.auth

    path = Path(secret_file)
    if path.exists() and stat.S_IMODE(path.stat().st_mode) & 0o077:
        raise ValueError(f"{path}: a secret key must not be readable by others (chmod 600)")
    public, secret = _load(zmq.auth.load_certificate, path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key (pass the {SECRET_SUFFIX} file)")
    return public, secret


def client_keys_from_args(args: argparse.Namespace) -> CurveClientKeys | None:
    """The client keys named by --curve-secret-key / --curve-server-key (both or neither)."""
    secret, server = args.curve_secret_key, args.curve_server_key
    if (secret is None) != (server is None):
        raise ValueError("--curve-secret-key and --curve-server-key go together")
    return None if secret is None else load_client_keys(secret, server)


def add_client_args(parser: argparse.ArgumentParser) -> None:
    """The two flags a CURVE client needs (for an engine on tcp:// with keys)."""
    parser.add_argument(
        "--curve-secret-key",
        default=None,
        help="this client's CURVE key pair (a .key_secret file from `tandem keygen`)",
    )
    parser.add_argument(
        "--curve-server-key",
        default=None,
        help="the engine's CURVE public key (its .key file)",
    )


# ---- sockets ----------------------------------------------------------------------------------


def make_server(sock: zmq.Socket, keys: CurveServerKeys) -> None:
    """Make ``sock`` a CURVE server (call before bind); clients are checked by the ZAP handler."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keys: CurveClientKeys) -> None:
    """Make ``sock`` a CURVE client of the engine whose public key ``keys`` holds (before
    connect)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


def start_authenticator(ctx: zmq.Context, keys: CurveServerKeys) -> ThreadAuthenticator:
    """The ZAP handler that admits only clients whose public key lies in the authorized
    directory. Without one, libzmq would let in any client that knows the engine's public key.
    Start it before binding; stop it before terminating ``ctx``."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("tandem.engine.auth"))
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.authorized_dir))
    return auth


def _load(loader: object, path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    try:
        return loader(path)  # type: ignore[operator]
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read CURVE key {path}: {exc}") from None


# ---- `tandem keygen` --------------------------------------------------------------------------


def create_key_pair(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write DIR/NAME.key (public) and DIR/NAME.key_secret (mode 0600); refuse to overwrite."""
    import zmq.auth

    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"key name {name!r} must be a plain file name")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = out / f"{name}{PUBLIC_SUFFIX}", out / f"{name}{SECRET_SUFFIX}"
    for path in (public, secret):
        if path.exists():
            raise ValueError(f"{path} exists: not overwriting a key")
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        zmq.auth.create_certificates(out, name)
    finally:
        os.umask(old_umask)
    os.chmod(public, 0o644)
    os.chmod(secret, 0o600)
    return public, secret


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, help="where to write the two key files")
    parser.add_argument("--name", required=True, help="file name stem: NAME.key, NAME.key_secret")


def run(args: argparse.Namespace) -> int:
    try:
        public, secret = create_key_pair(args.dir, args.name)
    except (ValueError, OSError) as exc:  # OSError: a folder it cannot make or write
        print(f"tandem keygen: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0
