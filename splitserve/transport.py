"""The wire between target ranks (producers) and trainer ranks (consumers).

Everything is a tensor moved with torch.distributed point-to-point calls; nothing is
pickled and nothing touches a file. Every message starts with a fixed ``int64`` header
of :data:`HEADER_LEN` values ``[MAGIC, kind, ...]``:

``SAMPLE`` (producer -> trainer, data group)
    header ``[MAGIC, SAMPLE, S, aux_dim, final_dim, dtype, id_bytes, seq_no,
    busy_us, idle_us, tokens, wall_us, chunk_end, n_dropped, dropped_bytes, 0]``
    (``busy_us`` to ``wall_us``: the producer's running accounting; ``chunk_end`` = 1
    on the last sample of a regeneration chunk sent on this link, which ``bench
    split`` times to; ``n_dropped`` and ``dropped_bytes``: how many ids of conversations
    the producer dropped (``data.min_loss_tokens``, special-token text in a reply) since its
    last sample follow, and their UTF-8 length; the trainer's checkpoint records them with this sample), then
    ``ints`` int64 ``[2*S + id_bytes + n_dropped + dropped_bytes]`` = input ids, loss
    mask, the sample id's UTF-8 bytes, the dropped ids' lengths and UTF-8 bytes, then
    ``feats`` ``[S, aux_dim + final_dim]`` in bf16 (aux and final side by side).
``END`` (producer -> trainer, data group)
    header only: the producer sends nothing more on this link.
``TENSOR`` (producer -> trainer, data group)
    header ``[MAGIC, TENSOR, dtype, ndim, d0, d1, d2, d3, ...]`` then the tensor,
    in its own dtype (the frozen embedding and lm_head travel this way).
``HELLO`` (trainer -> producer, ack group)
    header ``[MAGIC, HELLO, n_ids, n_bytes, ...]`` then ``int64 [n_ids]`` id
    lengths, ``uint8 [n_bytes]`` ids and ``int64 [n_ids]`` token counts: the
    sample ids the trainers already consumed (from their checkpoint), which the
    producer skips, each with its sample's tokens (0 for an id dropped as too
    short, -1 where the checkpoint did not record them), from which the producer
    replays its assignment of the samples to trainers.
``ACK`` (trainer -> producer, ack group)
    header ``[MAGIC, ACK, consumed, stop, ...]``: ``consumed`` is the running
    count of samples the trainer took off this link (credits come back);
    ``stop`` = 1 means the trainer needs nothing more. An unchanged count is
    the trainer's heartbeat.
``BEAT`` (producer -> trainer, data group)
    header only: the producer's heartbeat; receivers skip it.

Backpressure: a producer sends on a link only while ``sent - consumed <
credits``, so a trainer never holds more than ``credits`` samples of one link
in transit or queued. A dead peer surfaces as :class:`PeerDied` naming its rank:
gloo reports a closed connection at once to a receive from that peer (every receive
here names its peer: one from any source would wait out the timeout), a silent peer
after ``split.peer_timeout_s`` (the process group's timeout). A timeout on gloo closes
every connection of the group in that process, so each other receive or send there, pending
or later, fails with "Application timeout caused pair closure" naming its own peer, which may
well be alive: that error is taken for a side effect and reported as the timeout that caused it
(see :func:`_peer_died`), which names the silent peer.

Liveness: a peer busy longer than that (a target loading or generating, a
trainer building its draft, stepping or saving) is not silent. Each side
sends a heartbeat every ``split.peer_timeout_s / 4`` from a thread of its own
(:class:`AckLink` on a trainer, :class:`Pulse` on a producer) to every peer
that waits on it, so only a crashed or frozen process is reported. A
heartbeat goes only where a receive is posted for it (a gloo send waits for
its receive, and would time out): on the ack group, to producers that listen
for this trainer (always: from their start until its stop); on a data
link, to a trainer waiting there (for its embeddings, for a sample while it
has a credit, or for the end of the stream after its stop). A trainer fed by
several producers receives them in a fixed rotation, so it is sent no BEAT:
there, a producer busy past the timeout is still reported.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

MAGIC = 0x44464731  # "DFG1"
HEADER_LEN = 16
SAMPLE, END, TENSOR, HELLO, ACK, BEAT = 1, 2, 3, 4, 5, 6
KIND_NAMES = {SAMPLE: "SAMPLE", END: "END", TENSOR: "TENSOR", HELLO: "HELLO", ACK: "ACK",
              BEAT: "BEAT"}
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.bfloat16: 1,
    torch.float32: 2,
    torch.float16: 3,
    torch.int64: 4,
    torch.uint8: 5,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
WIRE_DTYPE = torch.bfloat16


class WireError(RuntimeError):
    """Peer ``rank`` sent something that is not a draftforge message."""

    def __init__(self, rank: int, message: str):
        self.rank = rank
        super().__init__(message)


class PeerDied(RuntimeError):
    """A peer rank closed its connection or stayed silent past the timeout."""

    def __init__(self, rank: int, role: str, doing: str, cause: BaseException | str):
        self.rank = rank
        self.role, self.doing = role, doing
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        self.detail = text
        # "pair closure": this op failed because another one on its process group timed out,
        # not because of its own peer (see _peer_died); True while that other op is unknown
        self.side_effect = PAIR_CLOSURE in text.lower()
        # gloo says "Timed out" where the op waited, and "Application timeout caused pair
        # closure" on a later op over the pair that the timeout closed (a silent peer both times)
        if "timed out" in text.lower() or "application timeout" in text.lower():
            why = f"sent nothing within the timeout (split.peer_timeout_s): {text}"
        else:
            why = f"died or closed its connection: {text}"
        who = f"{role} rank {rank}" if rank >= 0 else f"a {role} rank"
        super().__init__(f"{who} {why} (while {doing})")

    def again(self) -> PeerDied:
        """The same error, a new instance (to raise on another thread)."""
        return PeerDied(self.rank, self.role, self.doing, self.detail)


# gloo, when one receive or send times out, closes every connection ("pair") of that process
# group in this process: every other op over the group, pending or later, fails with this,
# whichever its peer (a live one as well)
PAIR_CLOSURE = "application timeout caused pair closure"
SIDE_EFFECT_WAIT_S = 2.0  # how long a "pair closure" waits for the timeout that caused it
_timeouts: dict[int, tuple[object, PeerDied]] = {}  # id(group) -> (group, its first timeout)
_timeouts_cond = threading.Condition()


def _group_key(group) -> object:
    if group is None:
        with contextlib.suppress(Exception):  # the default group, however it is named
            group = dist.group.WORLD
    return group


def _peer_died(peer: int, group, role: str, doing: str, exc: BaseException) -> PeerDied:
    """The :class:`PeerDied` for ``exc``, met by an op with ``peer`` on ``group``.

    A timeout is kept as the group's, and any error on a group after its timeout is that
    timeout's (its connections are closed). A "pair closure" is a side effect of a timeout on
    another op of the group (another thread's, at the same moment, or an earlier one's):
    that op's error, which names the silent peer, is returned instead, waited for up to
    :data:`SIDE_EFFECT_WAIT_S` (gloo closes the pairs before it raises the timeout). Where
    none comes, the error keeps ``side_effect`` set, for the caller to name the silent peer
    by what it heard (:meth:`AckListener.fail`)."""
    died = PeerDied(peer, role, doing, exc)
    key = _group_key(group)
    with _timeouts_cond:
        earlier = _timeouts.get(id(key))
    if earlier is not None:
        # the group timed out before: its connections are closed, so whatever this op met
        # (a pair closure, or under load a timeout of its own, on a live peer whose message
        # the closure lost) follows from that timeout, whose silent peer is the one to name
        return earlier[1].again()
    if died.side_effect:
        with _timeouts_cond:
            _timeouts_cond.wait_for(lambda: id(key) in _timeouts, timeout=SIDE_EFFECT_WAIT_S)
            cause = _timeouts.get(id(key))
        return cause[1].again() if cause is not None else died
    if "timed out" in died.detail.lower() and peer >= 0:
        with _timeouts_cond:
            if id(key) not in _timeouts:
                _timeouts[id(key)] = (key, died)  # the group held: its id is not reused
            _timeouts_cond.notify_all()
    return died


@dataclass
class WireSample:
    """A sample as it comes off the wire, with the sender's accounting."""

    sample_id: str
    input_ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] bool
    aux: torch.Tensor  # [S, aux_dim] bf16
    final: torch.Tensor  # [S, final_dim] bf16
    seq_no: int
    producer_stats: dict[str, float]
    chunk_end: bool = False
    dropped_ids: tuple[str, ...] = ()  # dropped by tokenisation (see the SAMPLE message)


def _header(kind: int, values: Sequence[int] = (), device: torch.device | str = "cpu"):
    if len(values) > HEADER_LEN - 2:
        raise ValueError(f"header holds {HEADER_LEN - 2} values, got {len(values)}")
    head = torch.zeros(HEADER_LEN, dtype=torch.int64)
    head[0], head[1] = MAGIC, kind
    if values:
        head[2 : 2 + len(values)] = torch.tensor([int(v) for v in values], dtype=torch.int64)
    return head.to(device)


def _check_header(head: list[int], src: int, expected: Iterable[int]) -> int:
    expected = tuple(expected)
    if head[0] != MAGIC:
        raise WireError(
            src, f"rank {src} sent a message without the draftforge header (got {head[0]:#x}); "
            "are both sides running the same draftforge version?"
        )
    if head[1] not in expected:
        names = ", ".join(KIND_NAMES.get(k, str(k)) for k in expected)
        raise WireError(
            src, f"rank {src} sent a {KIND_NAMES.get(head[1], head[1])} message where {names} was expected"
        )
    return head[1]


def settle(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` when it is a GPU (a no-op on the CPU, where gloo
    and the tensor ops return when done), so that a meter's block holds the time of its work."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _send(tensor: torch.Tensor, dst: int, group, role: str, doing: str) -> None:
    try:
        dist.send(tensor.contiguous(), dst=dst, group=group)
    except RuntimeError as exc:
        raise _peer_died(dst, group, role, doing, exc) from exc


def _recv(tensor: torch.Tensor, src: int | None, group, role: str, doing: str) -> int:
    try:
        return int(dist.recv(tensor, src=src, group=group))
    except RuntimeError as exc:
        raise _peer_died(-1 if src is None else src, group, role, doing, exc) from exc


def _recv_head(src: int, group, device, doing: str, expected: Iterable[int],
               on_beat: Callable[[], None] | None = None) -> list[int]:
    """The next header from producer ``src`` of one of the ``expected`` kinds; its
    heartbeats (BEAT) are skipped, each one calling ``on_beat``."""
    head_t = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    while True:
        _recv(head_t, src, group, "target", doing)
        head = head_t.tolist()
        if _check_header(head, src, (*expected, BEAT)) != BEAT:
            return head
        if on_beat is not None:
            on_beat()


# --------------------------------------------------------------------------- samples


def encode_sample(
    sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
    dropped_ids: Sequence[str] = (),
) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """The shape fields and the dropped-id fields of the header, the ``ints`` body and the
    bf16 ``feats`` body of a sample."""
    seq = int(input_ids.shape[0])
    if aux.shape[0] != seq or final.shape[0] != seq or loss_mask.shape[0] != seq:
        raise ValueError(f"sample {sample_id!r}: ids, mask, aux and final differ in length")
    id_bytes = sample_id.encode("utf-8")
    dropped = [i.encode("utf-8") for i in dropped_ids]
    tail = [*id_bytes, *(len(b) for b in dropped), *b"".join(dropped)]
    ints = torch.empty(2 * seq + len(tail), dtype=torch.int64, device=input_ids.device)
    ints[:seq] = input_ids
    ints[seq : 2 * seq] = loss_mask.to(torch.int64)
    if tail:
        ints[2 * seq :] = torch.tensor(tail, dtype=torch.int64)
    feats = torch.cat([aux.to(WIRE_DTYPE), final.to(WIRE_DTYPE)], dim=-1)
    fields = [seq, aux.shape[1], final.shape[1], DTYPE_CODES[WIRE_DTYPE], len(id_bytes)]
    return fields, [len(dropped), sum(len(b) for b in dropped)], ints, feats


def send_sample(
    dst: int,
    sample_id: str,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    aux: torch.Tensor,
    final: torch.Tensor,
    *,
    seq_no: int,
    stats: Sequence[int] = (0, 0, 0, 0),
    chunk_end: bool = False,
    dropped_ids: Sequence[str] = (),
    group=None,
    device: torch.device | str = "cpu",
    meter=None,
) -> None:
    """Send one sample to trainer ``dst`` (header, ints, bf16 features), with the ids of the
    conversations dropped since the last sample (``dropped_ids``).

    ``meter`` (an accounting ``Meter``): the header's send counts as idle ("turn"), since it
    waits until the trainer posts the matching receive (a trainer fed by several producers
    receives from them in turn); the copies to the device and the ints' and features' sends as
    busy ("send"). On a GPU each part waits for its stream (:func:`settle`), or its time would
    show up in the next part's: NCCL's send and a tensor's copy return before the work is done."""
    fields, dropped, ints, feats = encode_sample(sample_id, input_ids, loss_mask, aux, final, dropped_ids)
    doing = f"sending sample {sample_id!r}"
    busy = (lambda: meter.busy("send")) if meter is not None else contextlib.nullcontext
    with busy():  # the copies to the device, and whatever the stream still held before them
        head = _header(SAMPLE, [*fields, seq_no, *stats, int(chunk_end), *dropped], device)
        ints, feats = ints.to(device), feats.to(device)
        settle(device)
    with meter.idle("turn") if meter is not None else contextlib.nullcontext():
        _send(head, dst, group, "trainer", doing)
        settle(device)  # NCCL's send returns at once: its wait for the trainer ends here
    with busy():
        _send(ints, dst, group, "trainer", doing)
        _send(feats, dst, group, "trainer", doing)
        settle(device)


def send_end(dst: int, *, group=None, device: torch.device | str = "cpu") -> None:
    """Tell trainer ``dst`` that this producer sends nothing more."""
    _send(_header(END, device=device), dst, group, "trainer", "sending end-of-stream")


def recv_sample(
    src: int, *, group=None, device: torch.device | str = "cpu",
    on_beat: Callable[[], None] | None = None,
) -> WireSample | None:
    """The next message from producer ``src``: a sample, or None at end-of-stream
    (its heartbeats skipped, each calling ``on_beat``)."""
    head = _recv_head(src, group, device, "waiting for a sample", (SAMPLE, END), on_beat)
    if head[1] == END:
        return None
    seq, aux_dim, final_dim, dtype_code, id_len, seq_no, busy, idle, tokens, wall, chunk_end = head[2:13]
    num_dropped, dropped_len = head[13:15]
    dtype = CODE_DTYPES.get(dtype_code)
    if (dtype is None or seq <= 0 or aux_dim <= 0 or final_dim <= 0 or id_len < 0
            or num_dropped < 0 or dropped_len < 0):
        raise WireError(src, f"rank {src} sent a malformed sample header {head}")
    ints = torch.empty(2 * seq + id_len + num_dropped + dropped_len, dtype=torch.int64, device=device)
    _recv(ints, src, group, "target", "receiving a sample's token ids")
    feats = torch.empty(seq, aux_dim + final_dim, dtype=dtype, device=device)
    _recv(feats, src, group, "target", "receiving a sample's features")
    tail = ints[2 * seq :].cpu().tolist()
    what = f"the sample with seq_no {seq_no}"
    sample_id = _decode_ids([id_len], _bytes(tail[:id_len], src, what), src, what)[0]
    dropped = _decode_ids(tail[id_len : id_len + num_dropped],
                          _bytes(tail[id_len + num_dropped :], src, what), src, what)
    return WireSample(
        sample_id=sample_id,
        input_ids=ints[:seq].clone(),
        loss_mask=ints[seq : 2 * seq].bool(),
        aux=feats[:, :aux_dim].clone(),
        final=feats[:, aux_dim:].clone(),
        seq_no=seq_no,
        producer_stats={
            "busy_s": busy / 1e6,
            "idle_s": idle / 1e6,
            "tokens": float(tokens),
            "wall_s": wall / 1e6,
        },
        chunk_end=bool(chunk_end),
        dropped_ids=tuple(dropped),
    )


# --------------------------------------------------------------------------- tensors


def send_tensor(
    tensor: torch.Tensor, dst: int, *, group=None, device: torch.device | str = "cpu",
    what: str = "the target's embeddings",
) -> None:
    """Send one tensor of up to 4 dimensions in its own dtype (``what``: for errors)."""
    if tensor.dim() > 4 or tensor.dtype not in DTYPE_CODES:
        raise ValueError(f"cannot send a {tensor.dtype} tensor of shape {tuple(tensor.shape)}")
    head = _header(TENSOR, [DTYPE_CODES[tensor.dtype], tensor.dim(), *tensor.shape], device)
    _send(head, dst, group, "trainer", f"sending {what}")
    _send(tensor.to(device), dst, group, "trainer", f"sending {what}")


def recv_tensor(src: int, *, group=None, device: torch.device | str = "cpu",
                what: str = "the target's embeddings") -> torch.Tensor:
    """Receive a tensor sent by :func:`send_tensor` (heartbeats before it skipped; ``what``
    names it in errors)."""
    head = _recv_head(src, group, device, f"waiting for {what}", (TENSOR,))
    dtype, ndim = CODE_DTYPES.get(head[2]), head[3]
    if dtype is None or not 0 <= ndim <= 4 or any(d < 0 for d in head[4 : 4 + ndim]):
        raise WireError(src, f"rank {src} sent a malformed tensor header {head} for {what} "
                        f"(dtype code {head[2]}: known codes {sorted(CODE_DTYPES)}; at most 4 "
                        "dimensions, none negative)")
    out = torch.empty(head[4 : 4 + ndim], dtype=dtype, device=device)
    _recv(out, src, group, "target", f"receiving {what}")
    return out


# --------------------------------------------------------------------------- trainer -> producer


def send_hello(consumed: Mapping[str, int | None], dst: int, *, group) -> None:
    """Tell producer ``dst`` which sample ids the trainers already consumed, each with its
    sample's tokens (0: dropped as too short; None: not recorded)."""
    ids = sorted(consumed)
    encoded = [i.encode("utf-8") for i in ids]
    lengths = torch.tensor([len(b) for b in encoded], dtype=torch.int64)
    tokens = torch.tensor([-1 if consumed[i] is None else consumed[i] for i in ids], dtype=torch.int64)
    blob = b"".join(encoded)
    _send(_header(HELLO, [len(encoded), len(blob)]), dst, group, "target", "sending the resume state")
    if encoded:
        _send(lengths, dst, group, "target", "sending the resume state")
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
        _send(data, dst, group, "target", "sending the resume state")
        _send(tokens, dst, group, "target", "sending the resume state")


class AckListener:
    """Producer side of the ack group for the target rank's whole life: the resume states
    (HELLO), credits, stops and heartbeats (ACK) of the trainers ``srcs``.

    Posted when the target rank starts, before its target loads, and never paused: a
    trainer's heartbeat never waits for a receive, and a stop sent right after the
    resume state (a trainer that already has its steps) is kept. One thread per trainer
    receives from that trainer alone, since gloo fails such a receive at once when the
    trainer's connection closes (a receive from any source would wait out the timeout,
    naming no one). A thread ends after its trainer's stop, the trainer's last message.
    :meth:`result` waits for the resume states; :class:`CreditGate` reads the credits
    and stops. State is shared under :attr:`cond`.
    """

    def __init__(self, srcs: Sequence[int], *, group) -> None:
        self.srcs = list(srcs)
        self.ids: dict[str, int | None] = {}  # the consumed sample ids and tokens, from every HELLO
        self.hello_from: set[int] = set()
        self.consumed = dict.fromkeys(self.srcs, 0)  # the highest count each trainer acked
        self.stopped: set[int] = set()
        self.heard = dict.fromkeys(self.srcs, time.monotonic())  # each trainer's last message
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self._group = group
        self._threads = [threading.Thread(target=self._listen, args=(src,),
                                          name=f"draftforge-acks-{src}", daemon=True)
                         for src in self.srcs]
        for thread in self._threads:
            thread.start()

    def _listen(self, src: int) -> None:
        head_t = torch.empty(HEADER_LEN, dtype=torch.int64)
        while True:
            doing = (f"waiting for credits from trainer rank {src}" if src in self.hello_from
                     else f"waiting for the resume state of trainer rank {src}")
            try:
                _recv(head_t, src, self._group, "trainer", doing)
                head = head_t.tolist()
                kind = _check_header(head, src, (HELLO, ACK))
                ids = _hello_ids(head, src, self._group) if kind == HELLO else {}
            except BaseException as exc:  # noqa: BLE001 - raised on the producer thread
                self.fail(exc)
                return
            with self.cond:
                self.heard[src] = time.monotonic()
                if kind == HELLO:
                    # every trainer sends every rank's record; keep a count wherever one is known
                    self.ids.update((i, n) for i, n in ids.items() if self.ids.get(i) is None)
                    self.hello_from.add(src)
                else:
                    self.consumed[src] = max(self.consumed[src], head[2])
                    if head[3]:
                        self.stopped.add(src)
                self.cond.notify_all()
                if src in self.stopped:
                    return

    def fail(self, exc: BaseException) -> None:
        """Keep an error for the producer thread (the first one wins, but for a "pair closure"
        whose cause is unknown: any other error goes before it, and it names the trainer
        not heard from for longest, see :meth:`_silent_one`)."""
        with self.cond:
            if isinstance(exc, PeerDied) and exc.side_effect:
                exc = self._silent_one(exc)
            if self.error is None or (getattr(self.error, "side_effect", False)
                                      and not getattr(exc, "side_effect", False)):
                self.error = exc
            self.cond.notify_all()

    def _silent_one(self, exc: PeerDied) -> PeerDied:
        """For a "pair closure" met on ``exc.rank``'s connection (a timeout on another
        connection of the ack group closed it, and that timeout's own error did not come): the
        trainer not heard from for longest, of those that have not stopped (under :attr:`cond`)."""
        live = [src for src in self.srcs if src not in self.stopped] or [exc.rank]
        silent = min(live, key=lambda src: self.heard.get(src, 0.0))
        if silent == exc.rank:
            return exc
        last = self.heard.get(silent)
        heard = "never heard from" if last is None else f"last heard {time.monotonic() - last:.0f} s ago"
        died = PeerDied(silent, "trainer", f"waiting for credits from trainer rank {silent}",
                        f"Application timeout caused pair closure: trainer rank {silent}, {heard}, "
                        f"is the trainer silent longest (the closure came on trainer rank "
                        f"{exc.rank}'s connection)")
        died.side_effect = False
        return died

    def result(self) -> dict[str, int | None]:
        """The consumed sample ids of every trainer with their tokens (see :func:`send_hello`),
        once all have sent their resume state."""
        with self.cond:
            while self.error is None and len(self.hello_from) < len(self.srcs):
                self.cond.wait()
            if self.error is not None:
                raise self.error
            return dict(self.ids)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the threads to end (each ends after its trainer's stop)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def _hello_ids(head: list[int], src: int, group) -> dict[str, int | None]:
    """The rest of the HELLO whose header is ``head``: its sample ids and their tokens."""
    count, nbytes = head[2], head[3]
    if count < 0 or nbytes < 0:
        raise WireError(src, f"rank {src} sent a malformed HELLO header {head} (negative id count or size)")
    if count == 0:
        return {}
    lengths = torch.empty(count, dtype=torch.int64)
    _recv(lengths, src, group, "trainer", "receiving the resume state")
    data = torch.empty(nbytes, dtype=torch.uint8)
    _recv(data, src, group, "trainer", "receiving the resume state")
    ids = _decode_ids(lengths.tolist(), bytes(data.tolist()), src, "a HELLO (the consumed sample ids)")
    tokens = torch.empty(count, dtype=torch.int64)
    _recv(tokens, src, group, "trainer", "receiving the resume state")
    counts = tokens.tolist()
    if any(n < -1 for n in counts):
        raise WireError(src, f"rank {src} sent a HELLO with a negative token count ({min(counts)}); are "
                        "both sides running the same draftforge version?")
    return {i: None if n == -1 else n for i, n in zip(ids, counts, strict=True)}


def _bytes(values: Sequence[int], src: int, what: str) -> bytes:
    """``values`` (int64 off the wire) as bytes; :class:`WireError` naming rank ``src`` when one
    is not a byte (``what``: the message, for the error)."""
    bad = [v for v in values if not 0 <= v <= 255]
    if bad:
        raise WireError(src, f"rank {src} sent {what} whose id bytes are not all in 0-255 (e.g. "
                        f"{bad[0]}); are both sides running the same draftforge version?")
    return bytes(values)


def _decode_ids(lengths: Sequence[int], blob: bytes, src: int, what: str) -> list[str]:
    """The ids whose UTF-8 encodings of ``lengths`` lie one after another in ``blob``;
    :class:`WireError` naming rank ``src`` and ``what`` when they do not."""
    if any(length < 0 for length in lengths) or sum(lengths) != len(blob):
        raise WireError(src, f"rank {src} sent {what} whose id lengths {list(lengths)[:8]} do not add "
                        f"up to its {len(blob)} id bytes")
    ids, offset = [], 0
    for length in lengths:
        try:
            ids.append(blob[offset : offset + length].decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise WireError(src, f"rank {src} sent {what} whose ids are not UTF-8 ({exc})") from None
        offset += length
    return ids


def send_ack(dst: int, consumed: int, *, stop: bool = False, group) -> None:
    """Return credits to producer ``dst``: ``consumed`` samples taken off its link so far."""
    doing = "returning credits" if not stop else "telling it to stop"
    _send(_header(ACK, [consumed, int(stop)]), dst, group, "target", doing)


def _use_device(device: torch.device | str) -> None:
    """Make a CUDA ``device`` current on the calling thread (a thread starts on device 0)."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))


class _Heartbeat:
    """A daemon thread that calls :meth:`_send_beats` under :attr:`lock` every ``every_s``
    until :meth:`close`. A :class:`PeerDied` it meets, or any other error (a device it
    cannot use), ends it: kept in :attr:`error` and handed to :meth:`_failed`. Subclasses
    send their other messages under :attr:`lock` too, so a beat never lands between the
    parts of one, and call :meth:`_start` last in their ``__init__``."""

    def __init__(self, *, every_s: float, name: str, device: torch.device | str = "cpu"):
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self._every_s = every_s
        self._device = device
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            _use_device(self._device)
            while not self._halt.wait(self._every_s):
                with self.lock:
                    self._send_beats()
        except BaseException as exc:  # noqa: BLE001 - a dead peer or any other failure: kept, not lost with the thread
            with self.lock:
                self.error = exc
                self._failed(exc)

    def _send_beats(self) -> None:
        raise NotImplementedError

    def _failed(self, exc: BaseException) -> None:
        """Called (under :attr:`lock`) with the error that ended the heartbeat."""

    def close(self) -> None:
        """End the heartbeat (after the message it may be sending)."""
        self._halt.set()
        self._thread.join()


class AckLink(_Heartbeat):
    """Trainer side of the ack group: resume state, credits and stop, and a heartbeat.

    A thread repeats each producer's credit count every ``every_s`` (an unchanged count
    tells a producer only that this trainer lives), so a trainer busy longer than
    ``split.peer_timeout_s`` (waiting for its embeddings, building and resuming its
    draft, one step, one checkpoint save) is not reported dead. It beats to every
    source from the start: each producer listens on the ack group from its own start
    (:class:`AckListener`, posted before its target loads). Messages go one at a time
    (a HELLO is three sends).
    """

    def __init__(self, sources: Sequence[int], *, group, every_s: float):
        super().__init__(every_s=every_s, name="draftforge-heartbeat")
        self.sources = list(sources)
        self.consumed = dict.fromkeys(self.sources, 0)
        self._group = group
        self._start()

    def _send_beats(self) -> None:
        for src in self.sources:
            send_ack(src, self.consumed[src], group=self._group)

    def check(self) -> None:
        """Raise what the heartbeat met (a producer that died)."""
        if self.error is not None:
            raise self.error

    def hello(self, consumed: Mapping[str, int | None]) -> None:
        """Send every producer the consumed sample ids and tokens (:func:`send_hello`)."""
        for src in self.sources:
            with self.lock:
                send_hello(consumed, src, group=self._group)

    def ack(self, src: int, consumed: int) -> None:
        """Return credits to ``src``: ``consumed`` samples taken off its link so far."""
        with self.lock:
            self.consumed[src] = consumed
            send_ack(src, consumed, group=self._group)

    def stop(self) -> None:
        """End the heartbeat, then tell every producer to stop: its last message from here
        (a producer stops listening once all its trainers have stopped). A producer that
        died is skipped, and its :class:`PeerDied` raised once the others were told."""
        self.close()
        first: PeerDied | None = None
        with self.lock:
            for src in self.sources:  # a dead producer does not keep the stop from the others
                try:
                    send_ack(src, self.consumed[src], stop=True, group=self._group)
                except PeerDied as exc:
                    first = first or exc
        if first is not None:
            raise first


class CreditGate:
    """Producer side of the backpressure: per-trainer credits, refilled by ACK messages.

    The ACKs come through ``listener`` (an :class:`AckListener` on ``dests``, started
    here when None), which has received every one since the rank started, a stop sent
    before the gate existed included. The producer calls :meth:`acquire` before each
    send, for whichever of its links has a credit: a trainer whose link is full does not
    hold up the others. Every ACK, a heartbeat included, shows its trainer alive: a wait
    gives up on a trainer only after ``timeout_s`` without one, however long the trainer
    keeps its credits.
    """

    def __init__(self, dests: Sequence[int], credits: int, *, group=None, timeout_s: float,
                 listener: AckListener | None = None):
        if credits <= 0:
            raise ValueError(f"credits must be positive, got {credits}")
        if listener is None:
            listener = AckListener(dests, group=group)
        elif sorted(listener.srcs) != sorted(dests):
            raise ValueError(f"the listener hears trainers {listener.srcs}, not {list(dests)}")
        self.dests = list(dests)
        self.credits = credits
        self.timeout_s = timeout_s
        self.sent = dict.fromkeys(self.dests, 0)
        self.max_outstanding = 0
        self.listener = listener
        # the listener's state, shared under its condition
        self.consumed, self.stopped, self.heard = listener.consumed, listener.stopped, listener.heard
        self._cond = listener.cond

    @property
    def error(self) -> BaseException | None:
        return self.listener.error

    def outstanding(self, dest: int) -> int:
        """Samples sent to ``dest`` and not yet taken off its queue."""
        with self._cond:
            return self.sent[dest] - self.consumed[dest]

    def has_stopped(self, dest: int) -> bool:
        with self._cond:
            return dest in self.stopped

    def listens(self, dest: int) -> bool:
        """Whether trainer ``dest`` receives on its link now: it has a credit left (its
        receiver holds fewer samples than that) or it has stopped (it drains the link)."""
        with self._cond:
            return dest in self.stopped or self.sent[dest] - self.consumed[dest] < self.credits

    def fail(self, exc: BaseException) -> None:
        """Hand the producer thread an error met elsewhere (its first one wins)."""
        self.listener.fail(exc)

    def _silent(self, dests: Sequence[int], doing: str,
                timeout_s: float | None = None) -> PeerDied | None:
        """A :class:`PeerDied` for those of ``dests`` not heard from within ``timeout_s``
        (default: the gate's)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        now = time.monotonic()
        silent = [d for d in dests
                  if d not in self.stopped and now - self.heard[d] > timeout_s]
        if not silent:
            return None
        return PeerDied(silent[0] if len(silent) == 1 else -1, "trainer", doing,
                        f"Timed out: trainer ranks {silent} sent neither credits nor a heartbeat "
                        f"for {timeout_s:.0f} s")

    def acquire(self, dests: Sequence[int], *, block: bool = True) -> int | None:
        """The first of ``dests`` (stopped trainers aside) whose link has a credit, waiting
        for one when ``block``; None when all of them have stopped, or, without ``block``,
        when none has a credit now. A trainer that sends nothing, not even a heartbeat,
        for the timeout is hung: :class:`PeerDied` names it."""
        with self._cond:
            while True:
                if self.error is not None:
                    raise self.error
                live = [d for d in dests if d not in self.stopped]
                if not live:
                    return None
                for dest in live:
                    if self.sent[dest] - self.consumed[dest] < self.credits:
                        return dest
                if not block:
                    return None
                silent = self._silent(live, "waiting for credits")
                if silent is not None:
                    raise silent
                self._cond.wait(timeout=1.0)

    def note_sent(self, dest: int) -> None:
        """Count one sample sent to ``dest``."""
        with self._cond:
            self.sent[dest] += 1
            self.max_outstanding = max(self.max_outstanding, self.sent[dest] - self.consumed[dest])

    def all_stopped(self) -> bool:
        with self._cond:
            if self.error is not None:
                raise self.error
            return len(self.stopped) == len(self.dests)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the listener's threads to end (they end once every trainer has stopped)."""
        self.listener.join(timeout)

    def wait_all_stopped(self, timeout_s: float) -> bool:
        """Block until every trainer has said stop (True); raises if a peer died, and
        :class:`PeerDied` naming the trainers that sent nothing, not even a heartbeat, for
        ``timeout_s``."""
        with self._cond:
            while len(self.stopped) < len(self.dests) and self.error is None:
                live = [d for d in self.dests if d not in self.stopped]
                silent = self._silent(live, "waiting for the trainers to stop", timeout_s)
                if silent is not None:
                    raise silent
                self._cond.wait(timeout=1.0)
            if self.error is not None:
                raise self.error
            return True


class Pulse(_Heartbeat):
    """Producer side of the liveness: a heartbeat (BEAT) on the data links.

    A thread sends a BEAT every ``every_s`` to each trainer in :attr:`waiting` that
    ``listens``, so a producer busy longer than ``split.peer_timeout_s`` (loading the
    target, answering a chunk of prompts, computing features) is not reported dead
    while its process lives. A gloo send waits for its receive and times out without
    one, so a BEAT goes only to a trainer that receives on the link now (``listens``,
    asked under :attr:`lock`). Every message on the links is sent under :attr:`lock`
    (and :attr:`waiting` changed under it), so a BEAT never splits a sample. An error
    (a trainer died) goes to ``on_error`` and ends the heartbeat.
    """

    def __init__(self, *, every_s: float, group=None, device: torch.device | str = "cpu"):
        super().__init__(every_s=every_s, name="draftforge-pulse", device=device)
        self.waiting: set[int] = set()
        self.listens: Callable[[int], bool] = lambda dest: True
        self.on_error: Callable[[BaseException], None] = lambda exc: None
        self._group = group
        self._start()

    def _send_beats(self) -> None:
        head = _header(BEAT, device=self._device)  # made in the thread, on its device
        for dest in sorted(self.waiting):
            if self.listens(dest):
                _send(head, dest, self._group, "trainer", "sending a heartbeat")

    def _failed(self, exc: BaseException) -> None:
        self.on_error(exc)

    def expect(self, dests: Iterable[int], *, listens: Callable[[int], bool] | None = None,
               on_error: Callable[[BaseException], None] | None = None) -> None:
        """From now on, beat to the trainers ``dests`` whenever ``listens(dest)`` (default:
        always: each waits for its next message on the link)."""
        with self.lock:
            self.waiting = set(dests)
            self.listens = listens or (lambda dest: True)
            self.on_error = on_error or (lambda exc: None)
            if self.error is not None:
                self.on_error(self.error)


# --------------------------------------------------------------------------- trainer side


class SampleReceiver:
    """Trainer side: one thread receiving from the trainer's producers in a fixed rotation.

    The rotation (source ``k`` after ``k - 1``, starting at ``start``) is the
    consumption order, so the stream a trainer sees does not depend on timing.
    The thread posts a receive on a link only while it holds fewer than
    ``credits`` samples of it, i.e. only when the producer may send: a pending
    receive that times out therefore means a silent producer, never a busy
    trainer (a busy producer sends heartbeats, which the thread skips;
    :attr:`heard` is when it last received anything or began to wait). Items
    are ``(src, WireSample)``; ``None`` marks the end of every source; a
    :class:`PeerDied` or :class:`WireError` raised in the thread is re-raised
    by :meth:`get`.
    """

    IDLE = object()  # returned by get() when nothing arrived within max_wait_s

    def __init__(
        self,
        sources: Sequence[int],
        *,
        credits: int,
        group=None,
        device: torch.device | str = "cpu",
        start: int = 0,
    ) -> None:
        self.sources = list(sources)
        self.credits = credits
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.heard = time.monotonic()
        self._group = group
        self._device = device
        self._start = start
        self._held = dict.fromkeys(self.sources, 0)
        self._left: list[int] = []  # the sources not ended when the thread failed, its current first
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="draftforge-recv", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        active = list(self.sources)
        index = self._start % len(active)
        try:
            _use_device(self._device)  # inside: a failure reaches get() instead of leaving it waiting
            while active:
                src = active[index % len(active)]
                with self._cond:
                    while self._held[src] >= self.credits:
                        self._cond.wait(timeout=1.0)
                self._hear()
                message = recv_sample(src, group=self._group, device=self._device,
                                      on_beat=self._hear)
                self._hear()
                if message is None:
                    position = active.index(src)
                    active.remove(src)
                    index = position
                    continue
                with self._cond:
                    self._held[src] += 1
                self.queue.put((src, message))
                index += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised on the consumer thread
            self.error = exc
            at = index % len(active)
            self._left = active[at:] + active[:at]
        self.queue.put(None)

    def _hear(self) -> None:
        self.heard = time.monotonic()

    def get(self, poll_s: float = 0.5, max_wait_s: float | None = None,
            check: Callable[[], None] | None = None):
        """The next ``(src, WireSample)``, None once every source has ended, or
        :attr:`IDLE` when nothing came within ``max_wait_s``. ``check`` runs at every poll
        while nothing has come and may raise: the trainer's acknowledgement link, whose
        heartbeat notices a dead producer that the data receive may never report (on NCCL
        a receive from a dead rank blocks in the GPU wait, not in an exception)."""
        deadline = None if max_wait_s is None else time.monotonic() + max_wait_s
        while True:
            try:
                item = self.queue.get(timeout=poll_s)
            except queue.Empty:
                if self.error is not None and self.queue.empty():
                    raise self.error from None
                if check is not None:
                    check()
                if deadline is not None and time.monotonic() >= deadline:
                    return self.IDLE
                continue
            if item is None:
                self.queue.put(None)  # stay at the end for later calls
                if self.error is not None:
                    raise self.error
                return None
            with self._cond:
                self._held[item[0]] -= 1
                self._cond.notify_all()
            return item

    def drain_rest(self) -> tuple[int, list[BaseException]]:
        """After the thread ended on one producer's :class:`PeerDied` or :class:`WireError` (its
        stream is out of step: nothing more is read from it; call only once the trainer
        has told its producers to stop): receive what the other producers still send, in the
        same rotation, until each one's END, so that none of them is left waiting in a send to
        this trainer, to report it dead once it exits. Returns the samples dropped and what
        ended the drain of another producer early (its :class:`PeerDied` or :class:`WireError`)."""
        self.join(timeout=5.0)
        failed = self.error.rank if isinstance(self.error, PeerDied | WireError) else None
        left = [src for src in self._left if src != failed]
        dropped, lost, index = 0, [], 0
        while left:
            src = left[index % len(left)]
            try:
                message = recv_sample(src, group=self._group, device=self._device, on_beat=self._hear)
            except (PeerDied, WireError) as exc:
                lost.append(exc)
                message = None
            if message is None:
                position = left.index(src)
                left.remove(src)
                index = position
                continue
            dropped += 1
            index += 1
        return dropped, lost

    def depth(self) -> int:
        """Samples received and not yet taken (the end marker not counted)."""
        return sum(1 for item in list(self.queue.queue) if item is not None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
