"""The executor side of the link: drive an `Executor` from plans received over ZeroMQ.

Two threads, so liveness never waits on compute:
- the *I/O thread* owns the DEALER socket. It sends the handshake (resent until
  acknowledged), heartbeats every `heartbeat_interval_s`, forwards results, and watches
  the scheduler: silence for `scheduler_timeout_s` means it is gone;
- the *main thread* runs plans and resets in arrival order from a queue and hands each
  answer back to the I/O thread over an inproc socket.

When the scheduler is gone the executor exits (default) or resets itself and registers
again under a new session (`reregister`). A supervised executor (`parent_pid`) also exits
as soon as its parent process is gone, whatever signals did or did not arrive. If the main
thread is stuck in a step when the process should exit, the I/O thread ends the process
after a grace period: an executor never outlives its scheduler as an orphan.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import structlog
import zmq

from kvserve.config import defaults
from kvserve.config.flags import flag
from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.protocol import Executor
from kvserve.link.curve import CurveKeys
from kvserve.link.endpoint import check_endpoint
from kvserve.protos import step_codec
from kvserve.protos.kvserve.v1 import executor_link_pb2 as pb

log = structlog.get_logger(__name__)

EXIT_GRACE_S = 5.0
"""How long the I/O thread lets a busy main thread finish before ending the process."""
PARENT_LOST_GRACE_S = 1.0
"""The same once the parent is gone: no one is left to take the step's result."""
PARENT_CHECK_S = 0.25
"""How often the I/O thread looks at its parent pid (at most; heartbeats may poll faster)."""
GOODBYE_LINGER_MS = 200
_RESULTS_ENDPOINT = "inproc://kvserve-executor-results"


class ExitReason(IntEnum):
    """Process exit codes of `kvserve executor`."""

    SHUTDOWN = 0
    REFUSED = defaults.EXECUTOR_REFUSED_EXIT
    """The configuration names something this executor cannot load or run (`ExecutorConfigError`)."""
    SCHEDULER_LOST = 3
    NEVER_CONNECTED = 4
    RANK_LOST = 5
    """A tensor-parallel rank died or hung (kvserve.executor.tensor_parallel): the group ends for a restart."""


@dataclass(slots=True)
class LinkWorkerConfig:
    endpoint: str = field(
        metadata=flag(
            "the scheduler's ZeroMQ endpoint: ipc://PATH or tcp://HOST:PORT", name="--link", metavar="ENDPOINT"
        )
    )
    heartbeat_interval_s: float = field(
        default=defaults.LINK_HEARTBEAT_INTERVAL_S, metadata=flag("send a heartbeat this often, also during long steps")
    )
    scheduler_timeout_s: float = field(
        default=defaults.SCHEDULER_TIMEOUT_S,
        metadata=flag("exit (or re-register) after hearing nothing from the scheduler this long"),
    )
    connect_timeout_s: float = field(
        default=defaults.EXECUTOR_CONNECT_TIMEOUT_S,
        metadata=flag("exit if no scheduler acknowledges the handshake within this time (0: wait forever)"),
    )
    reregister: bool = field(
        default=False,
        metadata=flag("when the scheduler vanishes, reset and wait to register with the next one instead of exiting"),
    )
    allow_remote: bool = field(
        default=False,
        metadata=flag(
            "allow a tcp link to a non-loopback address (use CURVE keys or a private network)",
            name="--allow-remote-link",
        ),
    )
    curve_keys: CurveKeys | None = None
    """CURVE client keys; `peer_public_keys[0]` must be the scheduler's public key."""
    parent_pid: int | None = None
    """Exit (SCHEDULER_LOST) once this is no longer our parent's pid. `kvserve serve` sets it for its
    child: PR_SET_PDEATHSIG alone is Linux-only and can be lost (a handler that is not running,
    a step that holds the main thread), while getppid() changes for sure when the parent dies."""


@dataclass(slots=True)
class _Work:
    session_id: str
    envelope: pb.SchedulerMessage


_STOP = object()


class LinkWorker:
    """Serve one executor over the link until told to shut down or the scheduler is gone."""

    def __init__(self, executor: Executor, config: LinkWorkerConfig) -> None:
        check_endpoint(config.endpoint, allow_remote=config.allow_remote)
        if config.curve_keys is not None and len(config.curve_keys.peer_public_keys) != 1:
            raise ValueError("CURVE on the executor needs exactly one peer key: the scheduler's public key")
        self.executor = executor
        self.config = config
        self._handshake_info = step_codec.encode_info(executor.info())
        self._ctx = zmq.Context()
        self._work: queue.Queue = queue.Queue()
        self._exit_reason = ExitReason.SHUTDOWN
        self._exit_grace_s = EXIT_GRACE_S
        self._stopping = False
        """A plain attribute, not a threading.Event: the signal handler sets it, and Event.set takes a
        lock that a second SIGTERM arriving inside the first handler would wait on forever."""
        self._main_done = threading.Event()
        self._io_ready = threading.Event()
        self._io_thread = threading.Thread(target=self._io_main, name="executor-link-io", daemon=True)

    def serve(self) -> ExitReason:
        """Block until shutdown; returns why the loop ended (the process exit code)."""
        self._io_thread.start()
        self._io_ready.wait()
        results = self._ctx.socket(zmq.PAIR)
        results.setsockopt(zmq.LINGER, 0)
        results.connect(_RESULTS_ENDPOINT)
        try:
            while True:
                item = self._next_work()
                if item is _STOP or self._stopping:
                    break
                reply = self._run(item.envelope)
                if reply is not None:
                    try:
                        results.send_multipart([item.session_id.encode(), reply.SerializeToString()], zmq.NOBLOCK)
                    except zmq.Again:
                        break  # the I/O thread is gone: the link has ended
        finally:
            self._main_done.set()
            results.close()
            self._stopping = True
            self._io_thread.join(timeout=EXIT_GRACE_S)
            self._ctx.term()
        return self._exit_reason

    def request_stop(self) -> None:
        """Ask the loop to end after the current step. Safe in a signal handler that interrupts
        itself (PR_SET_PDEATHSIG fires once per exiting thread of the parent, so a kill -9 of the
        scheduler sends a burst of SIGTERMs): it stores a flag and takes no lock. Both threads
        poll the flag a few times a second."""
        self._stopping = True

    def install_signal_handlers(self) -> None:
        """SIGTERM / SIGINT end the process cleanly after the current step."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.request_stop())

    # --- main thread -----------------------------------------------------------

    def _next_work(self):
        while True:
            try:
                return self._work.get(timeout=0.5)  # wake up now and then so signals get handled
            except queue.Empty:
                if self._stopping:
                    return _STOP

    def _run(self, envelope: pb.SchedulerMessage) -> pb.ExecutorMessage | None:
        kind = envelope.WhichOneof("kind")
        if kind == "plan":
            step_id = envelope.plan.step_id
            try:
                plan = step_codec.decode_plan(envelope.plan)
                result = self.executor.execute(plan)
            except Exception as exc:
                log.error("step failed", step_id=step_id, error=str(exc), traceback=traceback.format_exc())
                return pb.ExecutorMessage(
                    error=pb.StepError(step_id=step_id, message=str(exc), error_type=type(exc).__name__)
                )
            reply = pb.ExecutorMessage()
            step_codec.encode_result(result, reply.result)
            return reply
        if kind == "reset":
            self.executor.reset()
            return pb.ExecutorMessage(reset_done=pb.ResetDone(reset_id=envelope.reset.reset_id))
        if kind == "load_adapter":
            load = envelope.load_adapter
            return self._adapters_changed(load.command_id, lambda: self.executor.load_adapter(load.name, load.path))
        if kind == "unload_adapter":
            unload = envelope.unload_adapter
            return self._adapters_changed(unload.command_id, lambda: self.executor.unload_adapter(unload.name))
        return None

    def _adapters_changed(self, command_id: int, change: Callable[[], list[str]]) -> pb.ExecutorMessage:
        """Run a LoRA load or unload; a refusal (ExecutorConfigError: the user's input) is answered with its
        message and logged without a traceback, anything else is a fault and logged with one."""
        try:
            names = change()
        except ExecutorConfigError as exc:
            log.warning("LoRA adapter change refused", error=str(exc))
            return pb.ExecutorMessage(adapters_changed=pb.AdaptersChanged(command_id=command_id, error=str(exc)))
        except Exception as exc:
            log.error("LoRA adapter change failed", error=repr(exc), traceback=traceback.format_exc())
            failed = f"the executor failed to change its LoRA adapters: {exc!r}"
            return pb.ExecutorMessage(adapters_changed=pb.AdaptersChanged(command_id=command_id, error=failed))
        # A later registration (--reregister) reports the adapters held now, not those of the start.
        self._handshake_info = step_codec.encode_info(self.executor.info())
        return pb.ExecutorMessage(adapters_changed=pb.AdaptersChanged(command_id=command_id, lora_names=names))

    # --- I/O thread ------------------------------------------------------------

    def _io_main(self) -> None:
        results = self._ctx.socket(zmq.PAIR)
        results.setsockopt(zmq.LINGER, 0)
        results.bind(_RESULTS_ENDPOINT)
        self._io_ready.set()
        try:
            self._io_loop(results)
        except Exception:
            log.exception("executor link I/O thread failed")
            self._exit_reason = ExitReason.SCHEDULER_LOST
        finally:
            results.close()
            self._work.put(_STOP)
            if not self._main_done.wait(self._exit_grace_s):
                log.error(
                    "a step is still running after the link ended; exiting the process", reason=self._exit_reason.name
                )
                os._exit(int(self._exit_reason))

    def _io_loop(self, results: zmq.Socket) -> None:
        """One registration after another until one of them ends the process."""
        started = time.monotonic()
        while not self._stopping:
            session = self._connect()
            try:
                if not self._serve_session(session, results, started):
                    return
            finally:
                session.sock.close(linger=0)  # no-op when already closed after a goodbye
            self._work.put(_Work(session.session_id, _local_reset()))

    def _serve_session(self, session: _Session, results: zmq.Socket, started: float) -> bool:
        """Run one registration. True: the scheduler vanished and we register again."""
        cfg = self.config
        poller = zmq.Poller()
        poller.register(session.sock, zmq.POLLIN)
        poller.register(results, zmq.POLLIN)
        last_beat = 0.0
        poll_s = cfg.heartbeat_interval_s / 2
        if cfg.parent_pid is not None:
            poll_s = min(poll_s, PARENT_CHECK_S)
        log.info("executor link connecting", endpoint=cfg.endpoint, session=session.session_id)
        while not self._stopping:
            now = time.monotonic()
            if not session.acked and now - session.last_handshake >= cfg.heartbeat_interval_s:
                session.send(self._handshake(session.session_id))
                session.last_handshake = now
            if session.acked and now - last_beat >= cfg.heartbeat_interval_s:
                session.send(pb.ExecutorMessage(heartbeat=pb.Heartbeat(sent_at=time.time())).SerializeToString())
                last_beat = now
            session.flush()
            events = dict(poller.poll(timeout=max(1, int(poll_s * 1000))))
            if results in events:
                self._forward_results(results, session)
            if session.sock in events and self._receive(session):
                return False
            if cfg.parent_pid is not None and os.getppid() != cfg.parent_pid:
                log.error("parent process gone; exiting", parent_pid=cfg.parent_pid, ppid=os.getppid())
                self._exit_reason = ExitReason.SCHEDULER_LOST
                self._exit_grace_s = PARENT_LOST_GRACE_S
                return False
            now = time.monotonic()
            if session.acked and now - session.last_heard > cfg.scheduler_timeout_s:
                reason = f"no message from the scheduler for {now - session.last_heard:.1f}s"
                if cfg.reregister:
                    log.warning("scheduler lost; resetting and registering again", reason=reason)
                    return True
                log.error("scheduler lost; exiting", reason=reason)
                self._exit_reason = ExitReason.SCHEDULER_LOST
                return False
            if not session.acked and not cfg.reregister and 0 < cfg.connect_timeout_s < now - started:
                log.error("no scheduler acknowledged the handshake; exiting", waited_s=round(now - started, 1))
                self._exit_reason = ExitReason.NEVER_CONNECTED
                return False
        if session.acked:  # stopped by a signal: tell the scheduler now rather than let it time out
            self._say_goodbye(session)
        return False

    def _say_goodbye(self, session: _Session) -> None:
        session.send_reliably(pb.ExecutorMessage(goodbye=pb.Goodbye()).SerializeToString())
        session.sock.close(linger=GOODBYE_LINGER_MS)  # let the goodbye leave

    def _connect(self) -> _Session:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a scheduler not yet there
        keys = self.config.curve_keys
        if keys is not None:
            sock.curve_secretkey = keys.secret_key
            sock.curve_publickey = keys.public_key
            sock.curve_serverkey = keys.peer_public_keys[0]
        session_id = uuid.uuid4().hex
        sock.setsockopt(zmq.ROUTING_ID, session_id.encode())
        sock.connect(self.config.endpoint)
        return _Session(sock, session_id)

    def _handshake(self, session_id: str) -> bytes:
        hello = pb.Handshake(
            protocol_version=step_codec.PROTOCOL_VERSION,
            session_id=session_id,
            pid=os.getpid(),
            info=self._handshake_info,
        )
        return pb.ExecutorMessage(handshake=hello).SerializeToString()

    def _receive(self, session: _Session) -> bool:
        """Drain the scheduler's messages; True when told to shut down."""
        while True:
            try:
                data = session.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return False
            try:
                envelope = pb.SchedulerMessage.FromString(data)
            except Exception:
                log.warning("dropping undecodable message from the scheduler", bytes=len(data))
                continue
            session.last_heard = time.monotonic()
            kind = envelope.WhichOneof("kind")
            if kind == "handshake_ack":
                if envelope.handshake_ack.session_id == session.session_id and not session.acked:
                    session.acked = True
                    log.info("registered with the scheduler", generation=envelope.handshake_ack.generation)
            elif kind in ("plan", "reset", "load_adapter", "unload_adapter"):
                session.acked = True  # a plan (or command) implies the handshake arrived
                self._work.put(_Work(session.session_id, envelope))
            elif kind == "shutdown":
                log.info("scheduler asked the executor to shut down", reason=envelope.shutdown.reason)
                self._say_goodbye(session)
                self._exit_reason = ExitReason.SHUTDOWN
                return True

    def _forward_results(self, results: zmq.Socket, session: _Session) -> None:
        while True:
            try:
                tag, data = results.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if tag.decode() == session.session_id:
                session.send_reliably(data)
            # else: a step of a former registration finished late; its scheduler is gone


class _Session:
    """One registration with a scheduler: its DEALER socket and what we heard on it."""

    def __init__(self, sock: zmq.Socket, session_id: str) -> None:
        self.sock = sock
        self.session_id = session_id
        self.acked = False
        self.last_heard = time.monotonic()
        self.last_handshake = float("-inf")
        self.outbox: deque[bytes] = deque()
        """Answers not yet accepted by ZeroMQ (no connection for a moment); sent before anything new."""

    def send(self, data: bytes) -> None:
        """Best effort, for handshakes and heartbeats: dropped when it cannot leave now."""
        if not self.outbox:
            try:
                self.sock.send(data, zmq.NOBLOCK)
            except zmq.Again:
                pass  # not connected yet, or the scheduler stopped reading: liveness decides

    def send_reliably(self, data: bytes) -> None:
        """For results, errors and acks: kept and retried until the connection takes them."""
        self.outbox.append(data)
        self.flush()

    def flush(self) -> None:
        while self.outbox:
            try:
                self.sock.send(self.outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self.outbox.popleft()


def _local_reset() -> pb.SchedulerMessage:
    """A marker work item: reset the executor without answering anyone."""
    envelope = pb.SchedulerMessage()
    envelope.reset.reset_id = -1
    return envelope
