"""Auth: who may talk to a run's processes (docs/security.md).

Every run has a token, random and its own, in the 0600 file `token` of its (0700) run directory,
written when the directory is created. A process of the run finds it through the environment
variable RLCTL_TOKEN_FILE (the path of the file, never the token) or in its run directory; the
token itself never goes on a command line, into a log, run.json or the recipe, nor over the
wire to a rollout server or the trainer: each start of each of those processes has its own key
(role_key: derived from the token and a key_id the process draws when it starts, after it has
bound its port, and records in run.json), and a request carries only the key of the process it
goes to. Every HTTP endpoint of the run's servers but the probes (/health) asks for
`Authorization: Bearer <key>` (401 without it, 403 with a wrong one), SGLang's and vLLM's
servers included: they get their key as their api key from a 0600 YAML file of options
(`--config`) or their environment. Probes carry no credential. Listening sockets are bound to
the address the others reach them at (127.0.0.1 in a local run), never to all addresses.

Nothing here imports torch or aiohttp: `rlctl launch` creates the token through this module.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import signal
import socket
import sys
from pathlib import Path

from rlctl.errors import RunError

TOKEN_FILE_ENV = "RLCTL_TOKEN_FILE"
TOKEN_FILE = "token"
"""The token's file in the run directory."""
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""Paths answered without a token: probes. SGLang leaves exactly these prefixes open
(sglang/srt/utils/auth.py; tests/test_sglang_contract.py reads them from its wheels)."""
REDACTED = b"<run token>"
LEASE_ROLE = "pool-lease"
"""The role whose key (role_key(token, LEASE_ROLE, job)) a pooled run asks its pool for slices with."""

log = logging.getLogger("rlctl.process.auth")


def new_token() -> str:
    """A random token. One that begins with '-' is drawn again: SGLang's option parser would take
    `--api-key -...` for a flag."""
    while True:
        token = secrets.token_urlsafe(32)
        if token[0] != "-":
            return token


def write_secret(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600 from the start, then renamed into place)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # also when a stale temp file was there with another mode
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def create_token(run_dir: Path) -> None:
    """A new run's token, in run_dir/token (0600)."""
    write_secret(Path(run_dir) / TOKEN_FILE, new_token() + "\n")


def token_path(run_dir: Path | None = None) -> Path:
    """Where this process finds its run's token: RLCTL_TOKEN_FILE, else run_dir/token."""
    env = os.environ.get(TOKEN_FILE_ENV)
    if env:
        return Path(env)
    if run_dir is None:
        raise ValueError(f"no run directory and no {TOKEN_FILE_ENV}: cannot find the run's token")
    return Path(run_dir) / TOKEN_FILE


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in a file, or a ValueError naming the file."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the run's token ({e.strerror or e})") from None
    if not token:
        raise ValueError(f"{path}: the token file is empty")
    return token


def read_token(run_dir: Path | None = None) -> str:
    return read_token_file(token_path(run_dir))


def new_key_id() -> str:
    """A fresh name for the credential of one process start (not secret: run.json holds it)."""
    return secrets.token_hex(8)


def role_key(token: str, role: str, key_id: str) -> str:
    """The credential of one start of one process of the run (`role` as the run plan names it,
    `key_id` drawn when that process started): HMAC-SHA256 of the run's token over `role/key_id`.
    It opens that process only. A request carries the key of the process it is meant for, never
    the run's token: whoever answers in that process's place (a process that took a dead server's
    port before its restart) learns a key that opens nothing else, and nothing once the process
    restarts under a new key_id. The prefix keeps the first character off '-' (SGLang's parser)."""
    mac = hmac.new(token.encode(), f"{role}/{key_id}".encode(), hashlib.sha256).digest()
    return "rk_" + base64.urlsafe_b64encode(mac).decode().rstrip("=")


def key_of(token: str, processes: dict, role: str) -> str:
    """`role`'s current key, from the key_id its newest start recorded in run.json's processes;
    a RunError when it recorded none (another process answering on its port, or one started
    before it had bound its port)."""
    key_id = (processes.get(role) or {}).get("key_id")
    if not isinstance(key_id, str) or not key_id:
        raise RunError(f"{role} has recorded no key in run.json: a process that is not the run's may be on its port")
    return role_key(token, role, key_id)


def bearer(token: str | None) -> dict[str, str]:
    """The header that carries the token ({} without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def refusal(path: str, authorization: str | None, token: str | None) -> int | None:
    """None when a request may pass, else its HTTP status: 401 without credentials, 403 with
    wrong ones (SGLang answers 401 to both). No token configured = open (an ad-hoc server)."""
    if not token or path.startswith(OPEN_PREFIXES):
        return None
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return 401
    return None if hmac.compare_digest(given.strip().encode(), token.encode()) else 403


def token_middleware(token: str | None):
    """The aiohttp middleware of a run's HTTP servers (the built-in rollout server, the trainer
    service): refusal() as a reply, with SGLang's refusal body."""
    from aiohttp import web

    @web.middleware
    async def door(request: web.Request, handler):
        status = refusal(request.path, request.headers.get("Authorization"), token)
        if status is not None:
            return web.json_response({"error": "Unauthorized" if status == 401 else "Forbidden"}, status=status)
        return await handler(request)

    return door


def listen_address(host: str) -> str:
    """The address to bind for `host`, the name the others reach this process by: an IP as it
    is, a name resolved here. A name this node resolves to loopback only while it is not
    `localhost` (Debian's 127.0.1.1 line for the own hostname) would shut the other nodes out:
    then all addresses, with a warning."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise RunError(f"cannot resolve this node's name {host!r} to listen on it: {e}") from None
    addrs = [i[4][0] for i in infos]
    public = [a for a in addrs if not ipaddress.ip_address(a).is_loopback]
    if public or host == "localhost":
        return (public or addrs)[0]
    log.warning("%s resolves to %s on this node only; listening on all addresses", host, addrs[0])
    return "0.0.0.0"


def address_for_peers(host: str, peers: list[str]) -> str:
    """What to hand a program that binds `host` itself (vLLM's weight-transfer store: its
    StatelessProcessGroup binds master_address) so that `peers` reach it: `host` as it is when
    it is an IP, resolves here to an address other than loopback, or every peer is on loopback;
    else (Debian's 127.0.1.1 line for the own hostname) this node's address on the route to the
    first remote peer, which only a UDP socket's connect looks up (nothing is sent)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        addrs = [i[4][0] for i in socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)]
    except socket.gaierror as e:
        raise RunError(f"cannot resolve this node's name {host!r}: {e}") from None
    if any(not ipaddress.ip_address(a).is_loopback for a in addrs):
        return host
    remote = [p for p in peers if not _loopback(p)]
    if not remote:
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((remote[0], 9))
            mine = probe.getsockname()[0]
    except OSError as e:
        raise RunError(f"{host} resolves to {addrs[0]} (loopback) on this node, and no route leads to {remote[0]} "
                       f"({e}); map {host} to this node's address in /etc/hosts") from None
    log.warning("%s resolves to %s on this node only; the weight-transfer store binds %s instead", host, addrs[0], mine)
    return mine


def _loopback(host: str) -> bool:
    try:
        addrs = [i[4][0] for i in socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)]
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(a).is_loopback for a in addrs)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port only (for a torch TCPStore to take over)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((listen_address(host), port))
        s.listen(1024)
    except OSError:
        s.close()
        raise
    return s


def redact_output(secret: str) -> None:
    """From now on, what this process and every child writes to its stdout and stderr reaches
    them through a filter process that replaces `secret` with <run token>: for a program that
    logs its own arguments (SGLang logs its server_args, api key included). Call it just before
    exec; the filter ends when the last writer has closed the pipe. It is no child of the program
    (forked twice), so a program that kills its children as it exits (SGLang's launch_server does)
    does not cut off its own last words; it stays in the process group, which the launcher ends."""
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # os calls only from here, then _exit
        if os.fork() == 0:  # the filter
            os.close(w)
            _filter(r, 1, secret.encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(r)
    os.dup2(w, 1)
    os.dup2(w, 2)
    os.close(w)


def _filter(src: int, dst: int, secret: bytes) -> None:
    """Copy src to dst whole lines at a time (or all but a secret's length of a long line),
    secrets replaced; never returns."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # end with the writers, after their last words
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        buf = b""
        while chunk := os.read(src, 1 << 16):
            buf += chunk
            cut = buf.rfind(b"\n") + 1
            if not cut and len(buf) > 1 << 16:
                cut = len(buf) - len(secret) + 1
            if cut:
                os.write(dst, buf[:cut].replace(secret, REDACTED))
                buf = buf[cut:]
        if buf:
            os.write(dst, buf.replace(secret, REDACTED))
    finally:
        os._exit(0)
