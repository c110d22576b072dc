"""The scheduler side of the executor link: a ZeroMQ ROUTER socket driven from asyncio.

One executor at a time is *current*. Every handshake from a new registration (a new
process, or the same process re-registering after it reset itself) makes the sender
current and bumps `generation`, so the engine can tell that the executor's state is gone
and re-sync: steps in flight then fail with `ExecutorLost`.

Liveness: both sides send a heartbeat every `heartbeat_interval_s`. The executor is lost
when nothing arrived from it for `dead_after_s` (a SIGKILLed or SIGSTOPped process), when
ZeroMQ reports its connection gone (ROUTER_MANDATORY makes sending to it fail at once),
or when a step outlives `step_timeout_s` while heartbeats still flow (a stuck compute).
Incoming messages are always drained before the deadline is checked, so an event loop
that was busy for a while never mistakes queued heartbeats for silence.

This module is the link protocol and the asyncio step API over it; the ZeroMQ socket
itself (options, CURVE, how a failed send is reported) is link_socket.RouterSocket, the
futures that callers await are pending_replies.PendingReplies, and what a call raises
(`ExecutorLost`, `ExecutorStepError`) is link_errors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from kvserve.config import defaults
from kvserve.link.curve import CurveKeys
from kvserve.link.endpoint import check_endpoint
from kvserve.protos import step_codec
from kvserve.protos.kvserve.v1 import executor_link_pb2 as pb
from kvserve.protos.step import ExecutorInfo, StepPlan, StepResult
from kvserve.scheduler.server.executor_link.link_errors import ExecutorLost, ExecutorStepError
from kvserve.scheduler.server.executor_link.link_socket import LinkSocketError, RouterSocket, Sent
from kvserve.scheduler.server.executor_link.pending_replies import PendingReplies

log = structlog.get_logger(__name__)

SHUTDOWN_WAIT_S = 1.0
"""close() waits this long at most for the executor to acknowledge a Shutdown."""
RECEIVE_RETRY_S = 0.05
"""After a failed poll or receive, the receive loop tries again this much later."""
RECEIVE_ERRORS_LOGGED_EVERY = 100
"""A failure that repeats is logged at its first and every hundredth occurrence."""


@dataclass(slots=True)
class _Peer:
    identity: bytes
    session_id: str
    pid: int
    info: ExecutorInfo
    generation: int
    last_heard: float


class ExecutorLink:
    """Send StepPlans to the current executor and await its StepResults."""

    def __init__(
        self,
        endpoint: str,
        *,
        heartbeat_interval_s: float = defaults.LINK_HEARTBEAT_INTERVAL_S,
        dead_after_s: float = defaults.EXECUTOR_DEAD_AFTER_S,
        step_timeout_s: float | None = defaults.STEP_TIMEOUT_S,
        curve_keys: CurveKeys | None = None,
        allow_remote: bool = False,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        """`on_change(connected)` is called when an executor registers or is lost (e.g. for health)."""
        check_endpoint(endpoint, allow_remote=allow_remote)
        self.endpoint = endpoint
        self.heartbeat_interval_s = heartbeat_interval_s
        self.dead_after_s = dead_after_s
        self.step_timeout_s = step_timeout_s
        self._curve_keys = curve_keys
        self._on_change = on_change
        self._socket = RouterSocket(endpoint, curve_keys)
        self._tasks: list[asyncio.Task] = []
        self._peer: _Peer | None = None
        self._generation = 0
        self._connected = asyncio.Event()
        self._replies = PendingReplies()
        self._goodbye: asyncio.Future | None = None
        self._closed = False

    # --- public API ------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._peer is not None

    @property
    def info(self) -> ExecutorInfo | None:
        """The current executor's handshake info (None while none is connected)."""
        return self._peer.info if self._peer else None

    @property
    def generation(self) -> int:
        """Incremented at each new executor registration; 0 before the first."""
        return self._generation

    @property
    def executor_pid(self) -> int | None:
        return self._peer.pid if self._peer else None

    async def start(self) -> None:
        """Bind the ROUTER socket and start the receive and heartbeat tasks."""
        await self._socket.open()
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="executor-link-receive"),
            asyncio.create_task(self._heartbeat_loop(), name="executor-link-heartbeat"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._on_task_done)
        log.info("executor link listening", endpoint=self.endpoint, curve=self._curve_keys is not None)

    async def wait_for_executor(self, timeout_s: float | None = None) -> ExecutorInfo:
        """Return the connected executor's info, waiting for a handshake if none is connected.

        Raises TimeoutError after `timeout_s`. Compare `generation` before and after to
        know whether it is a new registration.
        """
        if self._closed:
            raise ExecutorLost("the executor link is closed")
        await asyncio.wait_for(self._connected.wait(), timeout_s)
        assert self._peer is not None
        return self._peer.info

    async def step(self, plan: StepPlan) -> StepResult:
        """Run one plan on the current executor. Raises ExecutorLost or ExecutorStepError."""
        peer = self._require_peer()
        if self._replies.awaits_step(plan.step_id):
            raise ValueError(f"step {plan.step_id} is already in flight")
        envelope = pb.SchedulerMessage()
        step_codec.encode_plan(plan, envelope.plan)
        future = self._replies.expect_step(plan.step_id)
        try:
            await self._send(peer, envelope.SerializeToString())
            return await future
        finally:
            self._replies.forget_step(plan.step_id)

    async def reset_executor(self) -> None:
        """Tell the executor to forget every sequence; returns once it has done so."""
        peer = self._require_peer()
        reset_id, future = self._replies.expect_reset()
        try:
            await self._send(peer, pb.SchedulerMessage(reset=pb.Reset(reset_id=reset_id)).SerializeToString())
            await future
        finally:
            self._replies.forget_reset(reset_id)

    async def load_adapter(self, name: str, path: str) -> list[str]:
        """Have the executor load the LoRA adapter in `path` as `name` (after the steps sent before);
        the adapters it holds then. Raises AdapterRefused (nothing changed) or ExecutorLost."""
        return await self._change_adapters(
            lambda command_id: pb.SchedulerMessage(
                load_adapter=pb.LoadAdapter(command_id=command_id, name=name, path=path)
            )
        )

    async def unload_adapter(self, name: str) -> list[str]:
        """Have the executor unload the LoRA adapter `name`; as `load_adapter`."""
        return await self._change_adapters(
            lambda command_id: pb.SchedulerMessage(unload_adapter=pb.UnloadAdapter(command_id=command_id, name=name))
        )

    async def _change_adapters(self, message: Callable[[int], pb.SchedulerMessage]) -> list[str]:
        peer = self._require_peer()
        command_id, future = self._replies.expect_adapter_change()
        try:
            await self._send(peer, message(command_id).SerializeToString())
            return await future
        finally:
            self._replies.forget_adapter_change(command_id)

    async def close(self, shutdown_executor: bool = True) -> None:
        """Stop the link; with `shutdown_executor`, ask the current executor to exit first."""
        if self._closed:
            return
        self._closed = True
        if shutdown_executor and self._peer is not None and self._socket.is_open:
            await self._shutdown_executor(self._peer)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._replies.fail_all(ExecutorLost("the executor link was closed"))
        self._peer = None
        self._connected.clear()
        await self._socket.close()
        log.info("executor link closed", endpoint=self.endpoint)

    async def _shutdown_executor(self, peer: _Peer) -> None:
        """Send Shutdown until the executor says Goodbye (a message sent just before the
        socket closes can be lost), for at most SHUTDOWN_WAIT_S."""
        self._goodbye = asyncio.get_running_loop().create_future()
        message = pb.SchedulerMessage(shutdown=pb.Shutdown(reason="scheduler closing")).SerializeToString()
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        while time.monotonic() < deadline and self._peer is peer:
            self._send_nowait(peer, message)
            try:
                await asyncio.wait_for(asyncio.shield(self._goodbye), 0.2)
                log.info("executor acknowledged shutdown", pid=peer.pid)
                return
            except TimeoutError:
                continue
        log.warning("executor did not acknowledge shutdown", pid=peer.pid)

    # --- receiving -------------------------------------------------------------

    async def _receive_loop(self) -> None:
        """Receive and check liveness until close(). An error of the socket itself is logged and the
        loop goes on: a loop that ended would leave the link deaf, taking no handshake and never
        noticing a dead executor, which is worse than any single failed poll."""
        sock = self._socket
        assert sock.is_open
        errors = 0
        while True:
            try:
                if await sock.poll(self._poll_timeout_ms()):
                    while await sock.poll(0):
                        frames = await sock.recv()
                        try:
                            self._handle_frames(frames)
                        except Exception:
                            log.exception("failed to handle a link message")
            except LinkSocketError as exc:
                if self._closed or not sock.is_open:
                    raise
                errors += 1
                if errors == 1 or errors % RECEIVE_ERRORS_LOGGED_EVERY == 0:
                    log.error("executor link receive failed; receiving on", error=repr(exc), errors=errors)
                await asyncio.sleep(RECEIVE_RETRY_S)
            self._check_deadlines()

    def _on_task_done(self, task: asyncio.Task) -> None:
        """A link task ends only at close(); one that ends before says why (it would be lost in close()'s gather)."""
        if task.cancelled() or self._closed:
            return
        log.error("executor link task ended before close", task=task.get_name(), error=repr(task.exception()))

    def _poll_timeout_ms(self) -> int:
        """Sleep until the earliest moment the current executor could be declared lost."""
        peer = self._peer
        if peer is None:
            return int(self.heartbeat_interval_s * 1000)
        deadline = peer.last_heard + self.dead_after_s
        oldest = self._replies.oldest_step_sent_at()
        if self.step_timeout_s is not None and oldest is not None:
            deadline = min(deadline, oldest + self.step_timeout_s)
        return max(1, int((deadline - time.monotonic()) * 1000) + 1)

    def _handle_frames(self, frames: list) -> None:
        if len(frames) != 2:
            log.warning("dropping malformed link message", frames=len(frames))
            return
        identity = frames[0].bytes
        try:
            message = pb.ExecutorMessage.FromString(frames[1].buffer)
        except Exception:
            log.warning("dropping undecodable link message", bytes=len(frames[1].buffer))
            return
        kind = message.WhichOneof("kind")
        if kind == "handshake":
            self._on_handshake(identity, message.handshake)
            return
        peer = self._peer
        if peer is None or identity != peer.identity:
            log.debug("ignoring message from a former executor", kind=kind)
            return
        peer.last_heard = time.monotonic()
        if kind == "result":
            self._replies.resolve_step(message.result.step_id, lambda: step_codec.decode_result(message.result))
        elif kind == "error":
            err = message.error
            if self._replies.awaits_step(err.step_id):
                self._replies.fail_step(err.step_id, ExecutorStepError(err.step_id, err.message, err.error_type))
            else:
                log.warning(
                    "executor reported an error", step_id=err.step_id, error=err.message, error_type=err.error_type
                )
        elif kind == "goodbye":  # it answers our Shutdown, or leaves on its own (SIGTERM)
            if self._goodbye is not None and not self._goodbye.done():
                self._goodbye.set_result(None)
            self._lose(f"the executor (pid {peer.pid}) shut down", notify=not self._closed)
        elif kind == "reset_done":
            self._replies.resolve_reset(message.reset_done.reset_id)
        elif kind == "adapters_changed":
            changed = message.adapters_changed
            self._replies.resolve_adapter_change(changed.command_id, changed.error, list(changed.lora_names))

    def _on_handshake(self, identity: bytes, handshake: pb.Handshake) -> None:
        current = self._peer
        if current is not None and current.identity == identity and current.session_id == handshake.session_id:
            current.last_heard = time.monotonic()
            self._send_nowait(current, self._ack(current))  # a resend: our ack was not seen yet
            return
        if handshake.protocol_version != step_codec.PROTOCOL_VERSION:
            log.error(
                "executor speaks another link protocol version; ignoring it",
                theirs=handshake.protocol_version,
                ours=step_codec.PROTOCOL_VERSION,
                pid=handshake.pid,
            )
            return
        if current is not None:
            self._lose(f"replaced by a new executor registration (pid {handshake.pid})", notify=False)
        self._generation += 1
        peer = _Peer(
            identity=identity,
            session_id=handshake.session_id,
            pid=handshake.pid,
            info=step_codec.decode_info(handshake.info),
            generation=self._generation,
            last_heard=time.monotonic(),
        )
        self._peer = peer
        self._connected.set()
        self._send_nowait(peer, self._ack(peer))
        log.info(
            "executor registered",
            generation=peer.generation,
            pid=peer.pid,
            model_id=peer.info.model_id,
            num_blocks=peer.info.num_blocks,
            block_size=peer.info.block_size,
            kind=peer.info.executor_kind,
        )
        self._notify(True)

    def _ack(self, peer: _Peer) -> bytes:
        ack = pb.HandshakeAck(session_id=peer.session_id, generation=peer.generation)
        return pb.SchedulerMessage(handshake_ack=ack).SerializeToString()

    # --- liveness --------------------------------------------------------------

    def _check_deadlines(self) -> None:
        peer = self._peer
        if peer is None:
            return
        now = time.monotonic()
        silent_for = now - peer.last_heard
        if silent_for > self.dead_after_s:
            self._lose(f"no message from the executor (pid {peer.pid}) for {silent_for:.1f}s")
            return
        step_id = None if self.step_timeout_s is None else self._replies.overdue_step(now, self.step_timeout_s)
        if step_id is not None:
            # Heartbeats flow but the compute is stuck: stop it, it is no use to us.
            self._send_nowait(
                peer,
                pb.SchedulerMessage(
                    shutdown=pb.Shutdown(reason=f"step {step_id} exceeded {self.step_timeout_s}s")
                ).SerializeToString(),
            )
            self._lose(f"step {step_id} got no answer within {self.step_timeout_s}s")

    def _lose(self, reason: str, *, notify: bool = True) -> None:
        peer = self._peer
        if peer is None:
            return
        log.warning("executor lost", reason=reason, generation=peer.generation, pid=peer.pid)
        self._peer = None
        self._connected.clear()
        self._replies.fail_all(ExecutorLost(reason))
        if notify:
            self._notify(False)

    def _notify(self, connected: bool) -> None:
        if self._on_change is not None:
            try:
                self._on_change(connected)
            except Exception:
                log.exception("executor link on_change callback failed")

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            peer = self._peer
            if peer is not None:
                beat = pb.SchedulerMessage(heartbeat=pb.Heartbeat(sent_at=time.time()))
                self._send_nowait(peer, beat.SerializeToString())

    # --- sending ---------------------------------------------------------------

    def _require_peer(self) -> _Peer:
        if self._closed:
            raise ExecutorLost("the executor link is closed")
        if self._peer is None:
            raise ExecutorLost("no executor is connected")
        return self._peer

    async def _send(self, peer: _Peer, data: bytes) -> None:
        if not self._send_nowait(peer, data):
            raise ExecutorLost(f"the executor (pid {peer.pid}) is unreachable")

    def _send_nowait(self, peer: _Peer, data: bytes) -> bool:
        """Send without waiting; a vanished peer is declared lost. False when not sent."""
        sent = self._socket.send_nowait(peer.identity, data)
        if sent is Sent.UNREACHABLE and self._peer is peer:
            self._lose(f"the executor's connection closed (pid {peer.pid})")
        return sent is Sent.OK
