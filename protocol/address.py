"""Engine addresses and the ZeroMQ socket pattern between an engine core and its clients.

Addresses
---------
One engine address names two endpoints, input (requests in) and output (step outputs out):

    ipc:///some/dir/engine   input ipc:///some/dir/engine-in, output ipc:///some/dir/engine-out
    tcp://HOST:PORT          input tcp://HOST:PORT,           output tcp://HOST:PORT+1
    IN,OUT                   any other pair, spelled out

The default is ipc inside a fresh private directory (mode 0700, see ``private_ipc_address``), so
only the user who started the engine can reach it. tcp on a non-loopback host is bound only with
CURVE keys (``protocol/curve.py``): ``bind_engine_sockets`` refuses it otherwise. Loopback tcp
without keys is allowed (any local user can reach it) and logged as such.

Socket pattern
--------------
The engine BINDS two ROUTER sockets, input and output. Each client CONNECTS two DEALER sockets
that carry the same routing id (16 random bytes per client): one to the engine's input, one to
its output. A request therefore reaches the engine as ``[routing id, frame]``, telling it which
client sent it, and the engine sends that client's replies as ``[routing id, frame]`` on the
output ROUTER, which delivers ``frame`` to that client's output DEALER alone. Two sockets rather
than one so the engine's input thread and its busy loop (which sends) each own a socket (ZMQ
sockets are not thread-safe) and a burst of step outputs never queues behind incoming requests.

Handshake: the client sends HELLO on its input DEALER every ~100 ms until READY arrives on its
output DEALER; the engine answers every HELLO with READY. The retry covers the moment when the
engine's input ROUTER already has the client's HELLO but its output ROUTER does not yet know the
client's output connection: with ROUTER_MANDATORY on, that send fails (``send_to_client``
returns False) and the next HELLO tries again.

High-water marks are 0 (unlimited) on every socket: ZMQ drops or blocks at the HWM, and a dropped
step output is a lost token and a request that never finishes. Memory is bounded instead by the
engine's limits (max_num_seqs, max_model_len) and by the client reading continuously.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common import env
from common.processes import pid_alive

if TYPE_CHECKING:
    import zmq

    from protocol.curve import CurveClientKeys, CurveServerKeys

logger = logging.getLogger(__name__)

IDENTITY_BYTES = 16
_IPC = "ipc://"
_TCP = "tcp://"
_DIR_PREFIX = "tandem-"  # a private ipc directory: tandem-PID-RANDOM
# A stale-looking private ipc directory younger than this is left alone (remove_stale_ipc_dirs).
STALE_IPC_DIR_S = 60.0
_IN_SUFFIX = "-in"
_OUT_SUFFIX = "-out"
# sun_path holds 108 bytes on Linux (104 on macOS); leave room for the terminating NUL.
_MAX_IPC_PATH = 100


@dataclass(frozen=True)
class EngineAddress:
    """The engine's two endpoints as ZMQ addresses (see the module docstring for the forms)."""

    input: str
    output: str

    @classmethod
    def parse(cls, text: str) -> EngineAddress:
        """Parse ``ipc://PATH``, ``tcp://HOST:PORT`` or an explicit ``IN,OUT`` pair."""
        text = text.strip()
        if "," in text:
            inp, _, out = text.partition(",")
            _check_endpoint(inp.strip())
            _check_endpoint(out.strip())
            return cls(inp.strip(), out.strip())
        if text.startswith(_IPC):
            path = text[len(_IPC) :]
            if not path:
                raise ValueError(f"empty ipc path in {text!r}")
            return cls(f"{text}{_IN_SUFFIX}", f"{text}{_OUT_SUFFIX}")
        if text.startswith(_TCP):
            host, port = _split_host_port(text)
            if port > 65534:
                raise ValueError(f"port {port} leaves no room for the output port {port + 1}")
            return cls(f"{_TCP}{host}:{port}", f"{_TCP}{host}:{port + 1}")
        raise ValueError(f"engine address must start with ipc:// or tcp://, got {text!r}")

    def __str__(self) -> str:
        if self.input.startswith(_IPC) and self.input.endswith(_IN_SUFFIX):
            base = self.input[: -len(_IN_SUFFIX)]
            if self.output == base + _OUT_SUFFIX:
                return base
        if self.input.startswith(_TCP) and self.output.startswith(_TCP):
            try:
                host, port = _split_host_port(self.input)
            except ValueError:
                return f"{self.input},{self.output}"
            if self.output == f"{_TCP}{host}:{port + 1}":
                return self.input
        return f"{self.input},{self.output}"

    @property
    def ipc_paths(self) -> list[str]:
        """Filesystem paths of the ipc endpoints (none for tcp)."""
        return [e[len(_IPC) :] for e in (self.input, self.output) if e.startswith(_IPC)]


def as_address(address: EngineAddress | str) -> EngineAddress:
    return address if isinstance(address, EngineAddress) else EngineAddress.parse(address)


def private_ipc_address(name: str = "engine") -> EngineAddress:
    """A fresh mode-0700 directory under $XDG_RUNTIME_DIR (or the temp dir) and an address in it,
    named for this process (``remove_stale_ipc_dirs`` takes those of processes gone).

    The caller owns the directory; ``remove_ipc_files`` cleans it up.
    """
    for base in _runtime_dirs():
        remove_stale_ipc_dirs(base)
        directory = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=base)
        path = os.path.join(directory, name)
        if len(path) + len(_OUT_SUFFIX) <= _MAX_IPC_PATH:
            os.chmod(directory, 0o700)  # mkdtemp already does; say it where it matters
            return EngineAddress.parse(f"{_IPC}{path}")
        os.rmdir(directory)
    raise OSError("no runtime directory gives an ipc path short enough for a unix socket")


def remove_ipc_files(address: EngineAddress) -> None:
    """Remove an ipc address's socket files and then their directory if it is left empty."""
    directories = set()
    for path in address.ipc_paths:
        directories.add(os.path.dirname(path))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    for directory in directories:
        with contextlib.suppress(OSError):  # not empty or already gone: not ours to force
            os.rmdir(directory)


def remove_stale_ipc_dirs(base: str) -> list[str]:
    """Remove the private ipc directories in ``base`` that a process killed before its cleanup
    (``kill -9``) left behind, and return them: this user's, named for a process that no longer
    runs, untouched for STALE_IPC_DIR_S, holding socket files and nothing else, none of which
    anybody listens on. An empty one stays: a server's directory is empty until its engine has
    loaded the model and bound, and one of another pid namespace sharing the folder would look
    dead from here."""
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        directory = os.path.join(base, name)
        pid = _creator_pid(name)
        if pid is None or not _owned_and_idle(directory) or pid_alive(pid):
            continue
        sockets = _stale_sockets(directory)
        if not sockets:
            continue
        with contextlib.suppress(OSError):
            for path in sockets:
                os.unlink(path)
            os.rmdir(directory)  # fails, and is left, if anything else appeared meanwhile
        if not os.path.lexists(directory):
            removed.append(directory)
    return removed


def _creator_pid(name: str) -> int | None:
    """The pid in a private ipc directory's name (tandem-PID-RANDOM), None for other names."""
    if not name.startswith(_DIR_PREFIX):
        return None
    pid, sep, _ = name[len(_DIR_PREFIX) :].partition("-")
    if not (sep and pid.isascii() and pid.isdigit() and len(pid) <= 10):
        return None
    return int(pid)


def _owned_and_idle(directory: str) -> bool:
    """A real directory (not a link) of this user, untouched for STALE_IPC_DIR_S."""
    try:
        info = os.lstat(directory)
    except OSError:
        return False
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
        and time.time() - info.st_mtime >= STALE_IPC_DIR_S
    )


def _stale_sockets(directory: str) -> list[str]:
    """The directory's entries where all are socket files nobody listens on, else none."""
    try:
        entries = [os.path.join(directory, n) for n in os.listdir(directory)]
        if not all(stat.S_ISSOCK(os.lstat(e).st_mode) for e in entries):
            return []
        if any(_listened_on(path) for path in entries):
            return []
    except OSError:  # cannot tell: leave it
        return []
    return entries


def _listened_on(path: str) -> bool:
    """Whether a process accepts connections on the unix socket file ``path`` (False where
    nobody listens or the file is gone); OSError where that cannot be told (a full backlog,
    no permission)."""
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    finally:
        probe.close()
    return True


class AddressInUse(OSError):
    """Another process listens on an ipc address that an engine was asked to bind."""


def check_ipc_free(address: EngineAddress) -> None:
    """AddressInUse where a live process listens on one of ``address``'s ipc socket files.
    ZMQ binds an ipc path by replacing its file, so a second engine on a live engine's address
    would take the path over (new clients reach it, the first engine's own stay) with no error;
    a file nobody listens on (a dead engine's) is stale, and the bind replaces it."""
    for path in address.ipc_paths:
        if not os.path.exists(path):
            continue
        try:
            listened = _listened_on(path)
        except OSError as exc:  # busy (a full backlog), or not ours to try: take nothing over
            raise AddressInUse(
                f"cannot tell whether another process serves at {address} ({path}: "
                f"{exc.strerror or exc}): stop it, remove the file, or give another --address"
            ) from None
        if not listened:  # a stale file
            continue
        raise AddressInUse(
            f"another process is serving at {address} (its socket {path} accepts connections): "
            "stop it first, or give another --address"
        )


def is_loopback(address: EngineAddress | str) -> bool:
    """True when every endpoint stays on this host: ipc, or tcp on localhost / 127.x / ::1.

    Host names other than "localhost" are not resolved and count as remote.
    """
    endpoints = [address.input, address.output] if isinstance(address, EngineAddress) else [address]
    return all(_endpoint_is_loopback(e) for e in endpoints)


def new_identity() -> bytes:
    """A random routing id; ZMQ reserves ids that start with a zero byte."""
    identity = os.urandom(IDENTITY_BYTES)
    return identity if identity[0] else b"\x01" + identity[1:]


def check_identity(identity: bytes) -> bytes:
    if not 1 <= len(identity) <= 255 or identity[0] == 0:
        raise ValueError("a routing id is 1 to 255 bytes and must not start with a zero byte")
    return identity


# ---- sockets ----------------------------------------------------------------------------------


def bind_engine_sockets(
    ctx: zmq.Context, address: EngineAddress | str, *, curve: CurveServerKeys | None = None
) -> tuple[zmq.Socket, zmq.Socket]:
    """Bind the engine's (input ROUTER, output ROUTER); see the module docstring.

    With ``curve`` both sockets are CURVE servers; the caller must have started the ZAP handler
    on ``ctx`` (``protocol.curve.start_authenticator``), which is what checks client keys. A tcp
    address on a non-loopback host without ``curve`` is refused with ValueError: it would be an
    unauthenticated, unencrypted socket on the network.
    """
    import zmq

    from protocol.codec import MAX_FRAME_BYTES
    from protocol.curve import make_server

    address = as_address(address)
    if curve is None and not is_loopback(address):
        raise ValueError(
            f"refusing to bind {address} without authentication: not loopback "
            "(give CURVE keys: --curve-secret-key and --curve-authorized-keys)"
        )
    if curve is None and address.input.startswith(_TCP):
        logger.warning("%s has no CURVE keys: every local user can reach this engine", address)
    inp = _socket(ctx, zmq.ROUTER)
    out = _socket(ctx, zmq.ROUTER)
    try:
        if curve is not None:
            make_server(inp, curve)
            make_server(out, curve)
        inp.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a peer sending more is disconnected
        # A client that reconnects with the same id (engine restart, network blip) takes over.
        inp.setsockopt(zmq.ROUTER_HANDOVER, 1)
        out.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Raise instead of silently dropping a message for a peer the ROUTER does not know.
        out.setsockopt(zmq.ROUTER_MANDATORY, 1)
        check_ipc_free(address)
        inp.bind(address.input)
        out.bind(address.output)
    except BaseException:
        inp.close(linger=0)
        out.close(linger=0)
        raise
    return inp, out


def recv_from_client(sock: zmq.Socket, flags: int = 0) -> tuple[bytes, bytes]:
    """One (routing id, frame) from the engine's input ROUTER.

    A message with other than one frame after the id is returned as an empty frame, which the
    codec rejects like any other malformed input.
    """
    parts = sock.recv_multipart(flags)
    return parts[0], parts[1] if len(parts) == 2 else b""


def send_to_client(sock: zmq.Socket, identity: bytes, frame: bytes) -> bool:
    """Send a frame to one client on the engine's output ROUTER.

    Returns False when the ROUTER does not know that client (not yet connected, or gone) rather
    than raising, so the engine can forget that client and carry on.
    """
    import zmq

    try:
        sock.send_multipart([identity, frame])
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return False
        raise
    return True


def connect_client_sockets(
    ctx: zmq.Context,
    address: EngineAddress | str,
    identity: bytes,
    curve: CurveClientKeys | None = None,
) -> tuple[zmq.Socket, zmq.Socket]:
    """A client's (input DEALER, output DEALER), both carrying ``identity`` as routing id, and
    both CURVE clients when ``curve`` is given (an engine with keys accepts nothing else).

    Works with a ``zmq.asyncio.Context`` too, returning asyncio sockets.
    """
    import zmq

    from protocol.curve import make_client

    address = as_address(address)
    check_identity(identity)
    inp = _socket(ctx, zmq.DEALER)
    out = _socket(ctx, zmq.DEALER)
    try:
        for sock, endpoint in ((inp, address.input), (out, address.output)):
            sock.setsockopt(zmq.ROUTING_ID, identity)
            if curve is not None:
                make_client(sock, curve)
            sock.connect(endpoint)
    except BaseException:
        inp.close(linger=0)
        out.close(linger=0)
        raise
    return inp, out


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT works; IPv4 addresses still do
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


# ---- parsing helpers --------------------------------------------------------------------------


def _runtime_dirs() -> list[str]:
    dirs = []
    xdg = env.xdg_runtime_dir()
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        dirs.append(xdg)
    dirs.append(tempfile.gettempdir())
    if "/tmp" not in dirs and os.path.isdir("/tmp"):
        dirs.append("/tmp")
    return dirs


def _split_host_port(endpoint: str) -> tuple[str, int]:
    host, sep, port_text = endpoint[len(_TCP) :].rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"tcp address must be tcp://HOST:PORT, got {endpoint!r}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port out of range in {endpoint!r}")
    return host, port


def _check_endpoint(endpoint: str) -> None:
    if endpoint.startswith(_TCP):
        _split_host_port(endpoint)
    elif not endpoint.startswith(_IPC) or len(endpoint) == len(_IPC):
        raise ValueError(f"endpoint must be ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")


def _endpoint_is_loopback(endpoint: str) -> bool:
    if endpoint.startswith(_IPC):
        return True
    if not endpoint.startswith(_TCP):
        return False
    host, _ = _split_host_port(endpoint)
    return is_loopback_host(host)


def is_loopback_host(host: str) -> bool:
    """localhost, 127.x or ::1 (bracketed or not); any other name is not resolved and counts
    as remote."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name (or "*") that we do not resolve: treat as remote
