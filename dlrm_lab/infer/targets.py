"""Systems under test by URL (`--target`): one runner (`infer.lab`), any server.

    in-process           the lab's server in this process (`infer.server.InferenceServer`), the default
    grpc://HOST:PORT     a `dlrm-lab serve`, over the lab's protocol (--rpc stream or unary)
    kserve://HOST:PORT[/MODEL]
                         any Open Inference Protocol (KServe v2) gRPC server: the lab's own, Triton,
                         KServe's model server. MODEL is the name it serves the model under (default:
                         the preset's name); the samples are the preset's, generated here.
    http://HOST:PORT[/MODEL]
                         any Open Inference Protocol (KServe v2) HTTP/REST server, as kserve:// (`serve.rest_remote`:
                         binary tensors where the server lists Triton's binary_tensor_data extension, else JSON).

A transport is one opener registered in `TRANSPORTS` under its scheme (`register_transport`): the remote ones from
above, by `serve.transports`, which imports gRPC only when their scheme is used (the in-process runner never loads
it). An opener takes the parsed target, the served models (names, presets, sample libraries) and the connection
options, and returns a context manager giving a `SystemUnderTest` whose `describe()` says what it knows of each model
(`infer.sut.ModelDescription`).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from dlrm_lab.errors import FieldError

IN_PROCESS = "in-process"
Opener = Callable[..., AbstractContextManager]
TRANSPORTS: dict[str, Opener] = {}  # remote scheme -> its opener
RPC_OF: dict[str, tuple[str, ...]] = {}  # the RPC kinds each remote scheme speaks, its default first
NAMED_MODEL: list[str] = []  # schemes whose URL may name the served model
URL_FORMS: dict[str, str] = {IN_PROCESS: IN_PROCESS}  # each scheme's URL, as the refusal of a bad one lists them


def register_transport(scheme: str, opener: Opener, rpcs: tuple[str, ...], names_model: bool = False) -> None:
    """Serve `scheme://HOST:PORT[/MODEL]` targets with `opener`, speaking `rpcs` (the first by default)."""
    TRANSPORTS[scheme], RPC_OF[scheme] = opener, rpcs
    if names_model and scheme not in NAMED_MODEL:
        NAMED_MODEL.append(scheme)
    URL_FORMS[scheme] = f"{scheme}://HOST:PORT" + ("[/MODEL]" if names_model else "")


@dataclass(frozen=True)
class Target:
    """A parsed `--target`."""

    url: str
    scheme: str
    address: str | None = None  # HOST:PORT
    model_name: str | None = None  # kserve, http: the name the server knows the model by

    @property
    def remote(self) -> bool:
        return self.scheme != IN_PROCESS

    @property
    def sets_policy(self) -> bool:
        """Whether the runner sets the layout, batching and precision of the system here (the lab's own server); a
        remote server is measured as it serves (neither protocol sets them)."""
        return not self.remote

    @property
    def on_this_host(self) -> bool:
        """Whether the server runs on this machine (its roof is this machine's profile)."""
        if self.address is None:
            return True
        host = self.address.rpartition(":")[0].strip("[]")
        if host in ("localhost", socket.gethostname(), socket.getfqdn()):
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


@dataclass(frozen=True)
class Connection:
    """How a remote target is reached (ignored in process)."""

    rpc: str | None = None  # None: the scheme's default
    concurrency: int = 1  # client connections; beyond one each is a process of its own (`serve.pool`)
    timeout_s: float = 30.0  # per query (its gRPC deadline)
    connect_timeout_s: float = 10.0
    unavailable_s: float = 3.0  # only UNAVAILABLE answers this long: the server is lost
    seed: int = 0  # kserve: the seed of the samples generated here


def parse_target(url: str) -> Target:
    """`url` as a Target; a bad one is one line naming it and what is allowed."""
    forms = list(URL_FORMS.values())
    allowed = f"{', '.join(forms[:-1])} or {forms[-1]}" if len(forms) > 1 else forms[0]
    if url in (IN_PROCESS, ""):
        return Target(IN_PROCESS, IN_PROCESS)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in TRANSPORTS:
        raise FieldError("target", f"{url!r}: allowed: {allowed}")
    address, _, model = rest.partition("/")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise FieldError("target", f"{url!r}: expected {scheme}://HOST:PORT (a port in 1-65535)")
    if model and scheme not in NAMED_MODEL:
        named = " or ".join(f"{s}://" for s in NAMED_MODEL)
        raise FieldError("target", f"{url!r}: only a {named} target names its model in the URL")
    return Target(url, scheme, address, model or None)


def check_connection(target: Target, conn: Connection) -> None:
    """The connection options against the target: one line naming the culprit."""
    if conn.rpc is not None and target.remote and conn.rpc not in RPC_OF[target.scheme]:
        raise FieldError("rpc", f"{conn.rpc!r}: {target.scheme}:// speaks {', '.join(RPC_OF[target.scheme])}")
    if not isinstance(conn.concurrency, int) or conn.concurrency < 1:
        raise FieldError("concurrency", f"{conn.concurrency!r}: must be a whole number >= 1")
    for field, value in (
        ("timeout_s", conn.timeout_s),
        ("connect_timeout_s", conn.connect_timeout_s),
        ("unavailable_s", conn.unavailable_s),
    ):
        if not value > 0:
            raise FieldError(field, f"{value!r}: must be > 0 seconds")


def check_remote_models(target: Target, models: list[Any]) -> None:
    """Refuse what a remote target cannot honour but the run would record as served: trained weights (`--checkpoint`)
    that only the remote server's own start can load."""
    if target.remote and (trained := [m.checkpoint for m in models if m.checkpoint]):
        raise FieldError(
            "checkpoint",
            f"{trained[0].path}: {{target}} {target.url}: a remote server serves the weights it "
            "loaded itself (give --checkpoint to its dlrm-lab serve); the run would claim weights it "
            "never served",
            "target",
        )


def check_served_by(target: Target, models: list[Any], *, device: str) -> None:
    """What the system at `target` must be able to serve, refused before any run directory exists: a remote server
    serves only the weights it loaded itself (`check_remote_models`) and holds its models in its own memory; the
    lab's own server must fit them in this machine's memory and make their builds here."""
    check_remote_models(target, models)
    if target.remote:
        return
    from dlrm_lab.infer.build import check_build_request  # torch: only where the lab's own server runs
    from dlrm_lab.infer.memory import check_fits

    check_fits(models, device=device)
    for m in models:
        check_build_request(m.build, m.spec)


@contextmanager
def reach(
    target: Target, models: list[Any], conn: Connection, **in_process: Any
) -> Iterator[Callable[[], AbstractContextManager]]:
    """The system at `target` in the two steps a run takes: a remote server is reached (and its models checked) on
    entering, before the run directory exists, so a mistake in --target leaves none; what it yields, `serving()`,
    gives the system under test inside the run: that remote server, or the lab's own server, started there so the
    run records how its start went."""
    if target.remote:
        with TRANSPORTS[target.scheme](target, models, conn) as sut:
            yield lambda: nullcontext(sut)
    else:
        yield lambda: open_in_process(target, models, conn, **in_process)


def open_target(target: Target, models: list[Any], conn: Connection, **in_process: Any) -> AbstractContextManager:
    """The system under test at `target` for `models` (infer.served.ServedModel: their names, presets and
    sample libraries; in process also how to serve them, with `in_process` the server's own options)."""
    if target.remote:
        return TRANSPORTS[target.scheme](target, models, conn)
    return open_in_process(target, models, conn, **in_process)


def open_in_process(target: Target, models: list[Any], conn: Connection, **options: Any) -> AbstractContextManager:
    """The lab's server in this process, given a resolved serving plan (`infer.plan`): the choices are made here,
    before it starts; the server executes them."""
    from dlrm_lab.infer.plan import plan_serving
    from dlrm_lab.infer.server import InferenceServer

    device, seed, log = options.get("device", "cpu"), options.get("seed", 0), options.get("log")
    plan = plan_serving(models, device=device, seed=seed, log=log)
    return InferenceServer(plan, **{k: v for k, v in options.items() if k not in ("device", "seed")})
