"""Private Redis servers for tests, demos and benchmarks.

:class:`RedisServer` starts its own ``redis-server`` on a free loopback port, with no
persistence, and stops it on exit; it never touches a Redis it did not start::

    from tests.support.servers import RedisServer

    with RedisServer() as server:
        limiter = Limiter.from_url(server.url)

With ``tls=TlsFiles.generate(directory)`` it listens over TLS only (``rediss://``), with
``acl=[...]`` it has ACL users (``users`` lines of an ACL file), and :class:`RedisSentinel`
starts a ``redis-server --sentinel`` watching one of them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import quote

import redis

__all__ = [
    "RedisSentinel",
    "RedisServer",
    "Service",
    "TlsFiles",
    "free_port",
    "redis_url_from_env",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class TlsFiles:
    """A test CA and a server and client certificate signed by it (PEM files)."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def generate(cls, directory: Path, host: str = "127.0.0.1") -> TlsFiles:
        """Make them with the ``openssl`` CLI in ``directory``: P-256 keys (fast to make),
        valid one day, the server's for ``host`` (an IP address, in subjectAltName, so that
        clients can check the host name)."""
        if shutil.which("openssl") is None:
            raise FileNotFoundError("openssl is not on PATH: apt-get install openssl")
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

        def run(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True)

        # The extensions Python 3.13's strict verification (ssl.VERIFY_X509_STRICT, on in
        # its default context) requires: a critical CA constraint, key identifiers.
        run("req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"),
            "-days", "1", "-subj", "/CN=throttle test CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-addext", "subjectKeyIdentifier=hash")  # fmt: skip
        leaf = (
            "basicConstraints=CA:FALSE\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
        )
        for name, cn, ext in (
            ("server", host, f"subjectAltName=IP:{host}"),
            ("client", "throttle test client", "extendedKeyUsage=clientAuth"),
        ):
            (d / f"{name}.ext").write_text(leaf + ext + "\n")
            run("req", *ec, "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"),
                "-subj", f"/CN={cn}")  # fmt: skip
            run("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.crt"),
                "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "1",
                "-out", str(d / f"{name}.crt"), "-extfile", str(d / f"{name}.ext"))  # fmt: skip
        return cls(
            d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key"
        )


class Service:
    """A process the tests start and stop: ``with Service() as running:`` starts it and
    stops it on the way out, even when the block raises."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RedisServer(Service):
    """A ``redis-server`` subprocess on a free loopback port.

    Parameters
    ----------
    args:
        Extra ``redis-server`` arguments, e.g. ``("--maxmemory", "10mb")``.
    executable:
        The server binary; found on PATH by default.
    start_timeout_s:
        How long to wait for the server to answer PING, in seconds.
    tls:
        Listen over TLS only (``--port 0 --tls-port PORT``) with these files.
    client_certs:
        With ``tls``: demand a client certificate signed by the CA (mutual TLS).
    acl:
        ACL file lines, e.g. ``"user limiter on >secret ~throttle:* +@all"``. The
        ``default`` user stays as Redis makes it (no password, every right) unless a line
        redefines it; :meth:`client` and readiness use it.
    """

    def __init__(
        self,
        args: tuple[str, ...] = (),
        *,
        executable: str = "redis-server",
        start_timeout_s: float = 10.0,
        tls: TlsFiles | None = None,
        client_certs: bool = False,
        acl: Sequence[str] = (),
    ) -> None:
        found = shutil.which(executable)
        if found is None:
            raise FileNotFoundError(
                f"{executable} is not on PATH: `make test` installs it "
                "(apt-get install redis-server)"
            )
        self.executable = found
        self.args = args
        self.start_timeout_s = start_timeout_s
        self.tls = tls
        self.client_certs = client_certs
        self.acl = tuple(acl)
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://...?ssl_ca_certs=...`` with TLS)."""
        return self.url_for()

    def url_for(self, username: str | None = None, password: str | None = None) -> str:
        """The URL of this server for a user (the password percent-encoded), with the TLS
        options (CA; the client certificate when required) in its query."""
        auth = ""
        if username is not None or password is not None:
            auth = f"{quote(username or '', safe='')}:{quote(password or '', safe='')}@"
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?" + "&".join(
            f"{name}={quote(str(value), safe='/')}" for name, value in self.tls_options().items()
        )

    def tls_options(self) -> dict[str, object]:
        """redis-py's ``ssl_*`` options for this server (empty without TLS)."""
        if self.tls is None:
            return {}
        options: dict[str, object] = {"ssl_ca_certs": str(self.tls.ca)}
        if self.client_certs:
            options["ssl_certfile"] = str(self.tls.client_cert)
            options["ssl_keyfile"] = str(self.tls.client_key)
        return options

    def client(self, **kwargs: object) -> redis.Redis:
        """A new redis-py client of this server (as its ``default`` user)."""
        if self.tls is not None:
            kwargs = {"ssl": True, **self.tls_options(), **kwargs}
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)  # type: ignore[arg-type]

    def _options(self) -> list[str]:
        """The TLS and ACL arguments of ``redis-server``."""
        assert self._dir is not None
        options = []
        if self.acl:
            aclfile = Path(self._dir.name) / "users.acl"
            aclfile.write_text("\n".join(self.acl) + "\n")
            options += ["--aclfile", str(aclfile)]
        if self.tls is not None:
            tls = self.tls
            options += [
                "--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(tls.cert), "--tls-key-file", str(tls.key),
                "--tls-ca-cert-file", str(tls.ca),
                "--tls-auth-clients", "yes" if self.client_certs else "no",
                "--tls-replication", "yes",
            ]  # fmt: skip
        return options

    def start(self) -> RedisServer:
        """Start the server (retrying on another port if one was taken meanwhile)."""
        self._dir = tempfile.TemporaryDirectory(prefix="throttle-redis-")
        for _ in range(5):
            self.port = free_port()
            log = Path(self._dir.name) / f"redis-{self.port}.log"
            self.process = subprocess.Popen(
                [
                    self.executable,
                    "--port", str(self.port),
                    "--bind", "127.0.0.1",
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", self._dir.name,
                    "--logfile", str(log),
                    *self._options(),
                    *self.args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            if self._wait_ready():
                return self
            self._kill()
        detail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        self.stop()
        raise RuntimeError(f"redis-server did not start: {detail}")

    def _wait_ready(self) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        client = self.client(socket_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()
        self.process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


class RedisSentinel(Service):
    """A ``redis-server --sentinel`` on a free loopback port, watching ``master`` as
    ``service`` (quorum 1: alone, it decides failovers), over TLS when the master is.

    Parameters
    ----------
    master:
        The (started) server to monitor; its ``default`` user must be able to run what a
        sentinel needs (INFO, ROLE, PING, SUBSCRIBE, PUBLISH, CLIENT, REPLICAOF, CONFIG...).
    service:
        The master's name in Sentinel (``sentinel monitor SERVICE``).
    down_after_ms:
        How long the master must be silent to be judged down, in ms.
    password:
        The sentinel's own ``requirepass`` (``None``: no password).
    """

    def __init__(
        self,
        master: RedisServer,
        service: str = "throttle",
        *,
        down_after_ms: int = 1000,
        password: str | None = None,
        start_timeout_s: float = 10.0,
    ) -> None:
        found = shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError("redis-server is not on PATH (apt-get install redis-server)")
        self.executable = found
        self.master = master
        self.service = service
        self.down_after_ms = down_after_ms
        self.password = password
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def _config(self) -> str:
        assert self._dir is not None
        lines = [
            "bind 127.0.0.1",
            f"dir {self._dir.name}",
            f"logfile {self._dir.name}/sentinel.log",
            f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1",
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
            f"sentinel failover-timeout {self.service} 10000",
        ]
        tls = self.master.tls
        if tls is None:
            lines.append(f"port {self.port}")
        else:
            lines += [
                "port 0",
                f"tls-port {self.port}",
                f"tls-cert-file {tls.cert}",
                f"tls-key-file {tls.key}",
                f"tls-ca-cert-file {tls.ca}",
                f"tls-auth-clients {'yes' if self.master.client_certs else 'no'}",
                "tls-replication yes",  # a sentinel talks TLS to the servers too
            ]
            if self.master.client_certs:
                lines += [f"tls-client-cert-file {tls.client_cert}",
                          f"tls-client-key-file {tls.client_key}"]  # fmt: skip
        if self.password is not None:
            lines.append(f"requirepass {self.password}")
        return "\n".join(lines) + "\n"

    def client(self, **kwargs: object) -> redis.Redis:
        """A new redis-py client of the sentinel."""
        options: dict[str, object] = {"password": self.password, **kwargs}
        if self.master.tls is not None:
            options = {"ssl": True, **self.master.tls_options(), **options}
        return redis.Redis(host="127.0.0.1", port=self.port, **options)  # type: ignore[arg-type]

    def url(self, username: str | None = None, password: str | None = None) -> str:
        """A ``redis+sentinel://`` URL of the master through this sentinel, for a user of
        the master (with the sentinel's own password and the TLS options in its query)."""
        auth = ""
        if username is not None or password is not None:
            auth = f"{quote(username or '', safe='')}:{quote(password or '', safe='')}@"
        query = {
            **self.master.tls_options(),
            **({"sentinel_password": self.password} if self.password is not None else {}),
        }
        scheme = "redis+sentinel" if self.master.tls is None else "rediss+sentinel"
        url = f"{scheme}://{auth}127.0.0.1:{self.port}/{self.service}/0"
        if query:
            url += "?" + "&".join(
                f"{name}={quote(str(value), safe='/')}" for name, value in query.items()
            )
        return url

    def master_address(self) -> tuple[str, int] | None:
        """The master's address as this sentinel knows it now."""
        with self.client(socket_timeout=2.0) as client:
            address = client.sentinel_get_master_addr_by_name(self.service)
        if address is None:
            return None
        host = address[0].decode() if isinstance(address[0], bytes) else str(address[0])
        return host, int(address[1])

    def start(self) -> RedisSentinel:
        """Start the sentinel; ready once it answers and names the master."""
        self._dir = tempfile.TemporaryDirectory(prefix="throttle-sentinel-")
        for _ in range(5):
            self.port = free_port()
            config = Path(self._dir.name) / "sentinel.conf"  # rewritten by the sentinel
            config.write_text(self._config())
            self.process = subprocess.Popen(
                [self.executable, str(config), "--sentinel"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            if self._wait_ready():
                return self
            self._stop_process()
        log = Path(self._dir.name) / "sentinel.log"
        detail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"redis-server --sentinel did not start: {detail}")

    def _wait_ready(self) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                if self.master_address() is not None:
                    return True
            except redis.ConnectionError:
                pass
            time.sleep(0.05)
        return False

    def _stop_process(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        """Stop the sentinel and remove its directory."""
        self._stop_process()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


def redis_url_from_env() -> str | None:
    """The user's ``THROTTLE_REDIS_URL``, if set (tests and demos then use that server)."""
    return os.environ.get("THROTTLE_REDIS_URL") or None
