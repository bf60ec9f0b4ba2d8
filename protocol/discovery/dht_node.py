"""One hivemind DHT peer, confined to the addresses it is given, with a deadline on every call.

hivemind's ``DHT`` runs a Kademlia node in a forked process, which in turn drives a libp2p
daemon (``p2pd``) that owns the sockets. :class:`DhtNode` starts that pair and wraps the few
calls discovery needs:

- **Start.** The p2p daemon listens on ``--listen HOST:PORT`` (default ``127.0.0.1:0``: loopback,
  any free port), tells others to dial ``--dht-announce`` (``HOST:PORT`` or a multiaddr: a port
  forward's outside address) when set, and joins the swarm
  through ``--peers`` (multiaddrs printed by running peers). Everything that would probe the real
  network is off: UPnP / NAT-PMP port mapping, AutoNAT (reachability is forced to "public" so
  libp2p does not go looking), circuit relays and auto-relay, and the IPFS bootstrap list. A peer
  therefore only ever contacts the addresses it was given and the peers they introduce.
  ``use_relay`` (``--use-relay``) turns libp2p's circuit relays and auto-relay on, best effort: a
  peer behind NAT may then be reached through a public peer that relays for it, when one is found.
  ``client_mode`` (``--client-mode``) is hivemind's DHT client mode: the peer stores and reads
  records through others but answers no DHT request, so nobody needs to dial it; its p2p daemon
  listens on no address at all (``no_listen``), its connections are the ones it opens. Startup
  has a deadline; unreachable initial peers give a :class:`DhtStartupError` that names them.
  With ``identity_path`` the peer's key is read from that file (made on first start, mode 0600:
  ``identity.py``), so its peer id and multiaddr are the same after a restart.
- **Calls.** ``store`` and ``get`` send the request to the DHT process and wait for the answer at
  most ``timeout`` (:class:`DhtCallTimeout` after). Requests may come from several threads (the
  training loop and a heartbeat); the pipe to the DHT process is not thread-safe, so sending is
  serialised by a lock while the waiting is not.
- **Stop.** ``shutdown`` stops the DHT node, which stops its p2p daemon; any daemon still alive
  afterwards (its parent was killed mid-way) is killed, so no ``p2pd`` outlives the node.

Clock: expiration times are absolute seconds on ``hivemind.utils.get_dht_time()`` (wall-clock
time, assumed roughly synchronised between peers; a skew of a few seconds shortens or lengthens
every TTL by that much).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration

from protocol.auth.dht import SwarmKeyValidator
from protocol.auth.key import SwarmKey
from protocol.discovery.addresses import announce_multiaddr, check_peer_multiaddr, listen_multiaddr
from protocol.discovery.identity import check_identity_path, ensure_identity

if TYPE_CHECKING:
    from concurrent.futures import Future

    from hivemind.dht.node import DHTNode

logger = logging.getLogger(__name__)

# How long a stopping DHT process may take to stop its p2p daemon before it is killed.
_SHUTDOWN_GRACE = timedelta(seconds=3)


_PARENT_POLL = timedelta(seconds=1)
# How often a call's wait checks that the DHT process is still alive.
_LIVENESS_POLL = timedelta(seconds=0.5)


class _OwnedDHT(DHT):
    """hivemind's DHT process, tied to the process that started it.

    hivemind forks the DHT into a process of its own, which starts the p2p daemon. If the node
    dies without shutting it down (SIGKILL, OOM kill, a crash), both would go on serving a dead
    node's records and holding its ports. A watchdog thread in the DHT process notices the parent
    is gone (we are re-parented) and stops the daemon and itself.
    """

    def run(self) -> None:
        # A Ctrl-C or SIGTERM sent to the node's whole process group (a terminal, systemd, the launcher)
        # must not stop the DHT before the node has left the swarm through it: the node stops us with
        # shutdown() once it has stored its 'left' tombstone, and the watchdog if it dies. The p2p
        # daemon started below inherits the ignored signals.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        parent = os.getppid()
        threading.Thread(
            target=_stop_when_orphaned, args=(parent,), name="dht-parent-watch", daemon=True
        ).start()
        super().run()


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held (blocked, kept pending) in this thread while hivemind's DHT starts.

    The DHT's first shared future makes torch start its shared-memory manager (``torch_shm_manager``;
    hivemind sets the "file_system" sharing strategy), a child process in our process group. A Ctrl-C
    or SIGTERM sent to the group (a terminal, systemd, the launcher) killed it, and our main thread then
    waited inside ``share_memory_()``, in native code where no signal handler runs, forever: a node
    stopped during its start-up never exited. A child inherits the blocked signals, so the manager
    (and the DHT process, which ignores them anyway) never sees them; ours are delivered once the
    mask is restored, and the node's handlers act on them then.
    """
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _stop_when_orphaned(parent: int) -> None:
    """In the DHT process: once ``parent`` is gone, kill our children (the p2p daemon) and exit."""
    while os.getppid() == parent:  # for the life of the process; one cheap syscall a second
        time.sleep(_PARENT_POLL.total_seconds())
    for child in _child_pids(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    os._exit(1)


class DhtStartupError(RuntimeError):
    """The DHT peer did not start: the initial peers did not answer, or startup overran its deadline."""


class DhtNodeClosed(RuntimeError):
    """The node was shut down; no more DHT calls can be made through it."""


class DhtCallTimeout(TimeoutError):
    """A DHT store/get did not finish within its deadline."""


@dataclass(frozen=True, kw_only=True)
class DhtConfig:
    """Where a DHT peer listens, whom it joins, and how long it waits."""

    initial_peers: tuple[str, ...] = ()
    """``--peers``: multiaddrs (``/ip4/…/tcp/…/p2p/<peer id>``) of running peers; empty starts a new swarm."""
    listen: str = "127.0.0.1:0"
    """``--listen HOST:PORT``: the p2p daemon's TCP address; port 0 picks a free one."""
    announce: str | None = None
    """``--dht-announce``: the address others should dial, if not the listen address: ``HOST:PORT`` or a
    multiaddr (``/ip4/…/tcp/PORT``), e.g. a port forward's outside address; not for a client."""
    startup_timeout: timedelta = timedelta(seconds=20)
    """Deadline for starting the daemon and joining through ``initial_peers`` (p2pd gives up by 15 s itself)."""
    rpc_timeout: timedelta = timedelta(seconds=3)
    """hivemind's ``wait_timeout``: a DHT request to one peer counts as lost after this long."""
    identity_path: str | None = None
    """``--identity-path``: the file holding this peer's private key, made on first start (mode 0600),
    so the peer id (and, on a fixed port, the multiaddr) survives restarts (``identity.py``); None: a
    new identity at every start."""
    use_relay: bool = False
    """``--use-relay``: libp2p circuit relays and auto-relay (reach and be reached through a relaying
    peer when a direct connection fails); best effort, off by default so a peer contacts only the
    addresses it was given."""
    client_mode: bool = False
    """``--client-mode``: hivemind's DHT client mode; the peer answers no DHT request and its p2p daemon
    listens on nothing (nobody dials it; ``listen`` is unused), so it cannot start a swarm: it needs
    ``initial_peers``."""
    host_multiaddr: str = field(init=False)
    """``listen`` as a multiaddr (derived)."""
    announce_multiaddr: str | None = field(init=False)
    """``announce`` as a multiaddr (derived)."""

    def __post_init__(self) -> None:
        if isinstance(self.initial_peers, str):  # a lone string would be split into characters
            raise ValueError("initial_peers must be a sequence of multiaddrs, not one string")
        object.__setattr__(self, "initial_peers", tuple(check_peer_multiaddr(p) for p in self.initial_peers))
        object.__setattr__(self, "host_multiaddr", listen_multiaddr(self.listen))
        announced = None if self.announce is None else announce_multiaddr(self.announce)
        object.__setattr__(self, "announce_multiaddr", announced)
        for name in ("startup_timeout", "rpc_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.client_mode and not self.initial_peers:
            raise ValueError("a DHT client (client_mode) needs initial_peers: it cannot start a swarm")
        if self.client_mode and self.announce is not None:
            raise ValueError("a DHT client (client_mode) listens on nothing: it has no address to announce")
        if self.identity_path is not None:
            check_identity_path(Path(self.identity_path))  # made at start; an unusable one fails now

    def hivemind_kwargs(self) -> dict[str, object]:
        """Keyword arguments for ``hivemind.DHT`` (forwarded to ``DHTNode.create`` and ``P2P.create``)."""
        kwargs: dict[str, object] = dict(
            initial_peers=list(self.initial_peers),
            host_maddrs=[self.host_multiaddr],
            wait_timeout=self.rpc_timeout.total_seconds(),
            # Contact only the given addresses: no UPnP/NAT-PMP, no AutoNAT probing, no relays
            # unless asked for (a relay is a peer of the swarm that forwards for one behind NAT;
            # auto-relay looks for one only once AutoNAT found us unreachable, so it needs AutoNAT).
            nat_port_map=False,
            auto_nat=self.use_relay,
            force_reachability=None if self.use_relay else "public",
            use_relay=self.use_relay,
            use_auto_relay=self.use_relay,
            use_ipfs=False,
            client_mode=self.client_mode,
        )
        if self.client_mode:  # dial out only: the daemon binds no TCP (or QUIC) port at all
            kwargs.update(host_maddrs=[], no_listen=True)
        if self.announce_multiaddr is not None:
            kwargs["announce_maddrs"] = [self.announce_multiaddr]
        return kwargs


@dataclass(frozen=True)
class DhtEntry:
    """A value found in the DHT and the (DHT-clock) time it expires.

    For a key stored with subkeys, ``value`` is ``{subkey: DhtEntry}``.
    """

    value: object
    expiration_time: float


class DhtNode:
    """A running hivemind DHT peer; see the module docstring. Use as a context manager or call ``shutdown``."""

    def __init__(self, config: DhtConfig, *, swarm_key: SwarmKey | None = None) -> None:
        """With ``swarm_key``, our records are signed with it and records not signed with it are
        refused (``protocol.auth.dht``): peers without the key cannot announce themselves to us."""
        self.config = config
        self._send_lock = threading.Lock()
        self._closed = False
        identity: dict[str, object] = {}
        if config.identity_path is not None:
            try:
                expected_id, created = ensure_identity(Path(config.identity_path))
            except (OSError, ValueError) as error:
                raise DhtStartupError(
                    f"cannot use the identity file {config.identity_path}: {error}"
                ) from None
            # A restarted identity is checked against the swarm (hivemind asks whether a live peer
            # holds it already); a key made just now cannot be taken, so that round trip is skipped.
            identity = {"identity_path": config.identity_path, "check_if_identity_free": not created}
        # hivemind's DHT is a forked process. Garbage the child inherits and collects there may hold
        # gRPC objects whose finalizers wait on gRPC's threads, which a forked child does not have:
        # it hangs, and every DHT call times out. Collect it here, where those threads exist.
        gc.collect()
        with _stop_signals_held():
            self._dht = _OwnedDHT(
                start=True,
                await_ready=False,
                shutdown_timeout=_SHUTDOWN_GRACE.total_seconds(),
                record_validators=[] if swarm_key is None else [SwarmKeyValidator(swarm_key)],
                **config.hivemind_kwargs(),
                **identity,
            )
        try:
            self._dht.wait_until_ready(timeout=config.startup_timeout.total_seconds())
        except TimeoutError:
            _kill_dht_process(self._dht, grace=timedelta(0))
            raise DhtStartupError(
                f"the DHT peer did not start within {config.startup_timeout}; {_joining(config)}"
            ) from None
        except Exception as error:  # hivemind raises P2PDaemonError, RuntimeError, ...: all mean "no start"
            _kill_dht_process(self._dht, grace=_SHUTDOWN_GRACE)
            raise DhtStartupError(f"the DHT peer failed to start ({error}); {_joining(config)}") from error
        try:
            reply = self._call(_identity, config.startup_timeout, "identity")
        except BaseException:
            self.shutdown()
            raise
        assert isinstance(reply, tuple)  # what _identity returns
        self._peer_id, self._multiaddrs = str(reply[0]), [str(address) for address in reply[1]]
        if config.identity_path is not None and self._peer_id != expected_id:
            self.shutdown()
            raise DhtStartupError(
                f"the p2p daemon runs as {self._peer_id}, not {config.identity_path}'s {expected_id}"
            )

    @property
    def peer_id(self) -> str:
        """This peer's libp2p identity (base58), the subkey its records are stored under."""
        return self._peer_id

    @property
    def pid(self) -> int | None:
        """The DHT process id (its p2p daemon is a child of it)."""
        return self._dht.pid

    def is_alive(self) -> bool:
        return not self._closed and self._dht.is_alive()

    def visible_multiaddrs(self) -> list[str]:
        """Addresses others can pass to ``--peers``, each ending in ``/p2p/<peer id>``.

        Read once at start-up (the daemon's listen or announced addresses do not change while it
        runs): asking the p2p daemon again each time put a round trip through a DHT process that may
        be busy on a loaded host in the way of every caller, and a start-up could time out on it.
        """
        return list(self._multiaddrs)

    def reconnect(self, peer_ids: Sequence[str], timeout: timedelta | None = None) -> int:
        """Ping ``peer_ids`` so they are back in the routing table; returns how many answered.

        Kademlia drops peers that stop answering and hivemind blacklists them with a growing
        backoff, so after a partition heals each side keeps routing around the other forever
        unless someone knocks again: the daemon calls this for peers it lost from its view.
        """
        if not peer_ids:
            return 0
        answered = self._call(
            functools.partial(_ping_peers, tuple(peer_ids)),
            timeout or 2 * self.config.rpc_timeout,
            "reconnect",
        )
        assert isinstance(answered, int)
        return answered

    def store(
        self,
        key: str,
        value: object,
        *,
        expiration_time: float,
        subkey: str | None = None,
        timeout: timedelta,
    ) -> bool:
        """Store ``value`` under ``key`` (and ``subkey``) until ``expiration_time`` on the DHT clock.

        Returns False if no peer accepted it, for instance because a value with a later expiration
        is already there (the DHT keeps, per key/subkey, the value that expires last).
        """
        with self._send_lock:
            self._check_open()
            future = self._dht.store(key, value, expiration_time, subkey=subkey, return_future=True)
        return bool(_wait(future, timeout, f"store of {key!r}", alive=self._dht.is_alive))

    def get(self, key: str, *, latest: bool, timeout: timedelta) -> DhtEntry | None:
        """The unexpired value under ``key``, or None.

        ``latest=False`` stops at the first peer that has *a* value (possibly a cached copy with only
        some subkeys); ``latest=True`` asks every peer near the key and merges their subkeys, keeping
        the latest expiration of each: use it to list all live subkeys.
        """
        with self._send_lock:
            self._check_open()
            future = self._dht.get(key, latest=latest, return_future=True)
        found = _wait(future, timeout, f"get of {key!r}", alive=self._dht.is_alive)
        return None if found is None else _to_entry(found)

    def shutdown(self) -> None:
        """Stop the DHT node and its p2p daemon (killing them if they overrun the grace period)."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
        daemons = _child_pids(self._dht.pid)
        self._dht.shutdown()  # asks the node to stop p2pd and waits the grace period
        if self._dht.is_alive():  # hivemind's SIGTERM after the grace is ignored (see _OwnedDHT)
            self._dht.kill()
            self._dht.join(_SHUTDOWN_GRACE.total_seconds())
        _kill_leftover_daemons(daemons)

    def __enter__(self) -> DhtNode:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise DhtNodeClosed("the DHT node is shut down")

    def _call(self, coroutine: object, timeout: timedelta, what: str) -> object:
        with self._send_lock:
            self._check_open()
            future = self._dht.run_coroutine(coroutine, return_future=True)  # type: ignore[arg-type]
        return _wait(future, timeout, what, alive=self._dht.is_alive)


# --- helpers run inside the DHT process (module-level so that they pickle by reference) ---


async def _identity(_dht: DHT, node: DHTNode) -> tuple[str, list[str]]:
    """Our peer id and the addresses the daemon reported when it started (no new daemon request); a
    client's daemon listens on nothing, so it has none (hivemind would raise for an empty list)."""
    if node.protocol.client_mode:
        return node.peer_id.to_base58(), []
    addresses = await node.get_visible_maddrs(latest=False)
    return node.peer_id.to_base58(), [str(address) for address in addresses]


async def _ping_peers(peer_ids: tuple[str, ...], _dht: DHT, node: DHTNode) -> int:
    peers = [PeerID.from_base58(peer_id) for peer_id in peer_ids]
    for peer in peers:
        node.blacklist.register_success(peer)  # forget the backoff from the partition
    answers = await asyncio.gather(*(node.protocol.call_ping(peer) for peer in peers), return_exceptions=True)
    return sum(1 for answer in answers if answer is not None and not isinstance(answer, BaseException))


# --- helpers run in the caller ---


def _joining(config: DhtConfig) -> str:
    if not config.initial_peers:
        return f"it was starting a new swarm listening on {config.host_multiaddr}"
    return (
        f"none of the initial peers {list(config.initial_peers)} could be reached; check that each "
        "address is one a running peer printed and that its host and port are reachable from here"
    )


def _wait(future: Future[object], timeout: timedelta, what: str, *, alive: Callable[[], bool]) -> object:
    """The call's result within ``timeout``; sooner a :class:`DhtCallTimeout` once ``alive()`` is
    false (a DHT process that died answers nothing: no need to wait out the deadline)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        remaining = deadline - time.monotonic()
        try:
            return future.result(timeout=max(0.0, min(remaining, _LIVENESS_POLL.total_seconds())))
        except TimeoutError:
            gone = not alive()
            if remaining > _LIVENESS_POLL.total_seconds() and not gone:
                continue
            future.cancel()  # the DHT process finishes the request on its own; nobody waits for it
            if gone:
                raise DhtCallTimeout(f"DHT {what} got no answer: the DHT process is gone") from None
            raise DhtCallTimeout(f"DHT {what} did not finish within {timeout}") from None


def _to_entry(found: ValueWithExpiration) -> DhtEntry:
    value = found.value
    # hivemind returns a key stored with subkeys as {subkey: ValueWithExpiration}; a plain dict value
    # (stored without subkey) has plain values and is passed through as it is.
    if isinstance(value, dict) and all(isinstance(item, ValueWithExpiration) for item in value.values()):
        value = {subkey: DhtEntry(item.value, float(item.expiration_time)) for subkey, item in value.items()}
    return DhtEntry(value, float(found.expiration_time))


def _child_pids(pid: int | None) -> list[int]:
    """Children of ``pid`` (Linux ``/proc``); empty if it is gone or ``/proc`` is unavailable."""
    if pid is None:
        return []
    children: list[int] = []
    try:
        for thread_id in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{thread_id}/children") as listing:
                children.extend(int(child) for child in listing.read().split())
    except (FileNotFoundError, ProcessLookupError):
        logger.debug("process %s exited before its children were listed", pid)
    return children


def _is_live_daemon(pid: int) -> bool:
    """Whether ``pid`` is still a running (not zombie) p2p daemon."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline, open(f"/proc/{pid}/stat") as stat:
            is_daemon = b"p2pd" in cmdline.read().split(b"\0", 1)[0]
            state = stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return is_daemon and state != "Z"


def _kill_leftover_daemons(pids: list[int], *, expected: bool = False) -> None:
    """SIGKILL those of ``pids`` that are still running p2p daemons (``expected``: after a failed start)."""
    for pid in pids:
        if _is_live_daemon(pid):
            level = logging.DEBUG if expected else logging.WARNING
            logger.log(level, "p2p daemon %s outlived its DHT process; killing it", pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                logger.debug("p2p daemon %s exited on its own", pid)


def _kill_dht_process(dht: DHT, *, grace: timedelta) -> None:
    """Stop a DHT process that failed to start: let it exit within ``grace``, then kill it and its daemon."""
    daemons = _child_pids(dht.pid)
    dht.join(grace.total_seconds())
    if dht.is_alive():
        daemons = sorted(set(daemons) | set(_child_pids(dht.pid)))
        dht.kill()
        dht.join(_SHUTDOWN_GRACE.total_seconds())
    _kill_leftover_daemons(daemons, expected=True)
