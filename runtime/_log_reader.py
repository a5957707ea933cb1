"""Reading a delivery log: front to back, once, in bounded memory.

`LogReader` checks every line as it reads it (its number, its checksum, its
fields), resolves blob references against the blobs the writer held (the bound
the header states, forgotten in the same order), hands each delivery the fault
decisions its run's actor took while handling it, and gives the deliveries in
`seq` order. A delivery line is written when its handler returns, so on threads
the lines come a little out of `seq` order; the reader holds the early ones
(at most `REORDER_BYTES_MAX`) until those before them have come.

How the log ends decides what the reader gives:

- with its `end` line (its run closed it): every delivery, 1 up to the end
  line's count. One missing is damage.
- without (its run crashed, was killed, or is still running): the deliveries of
  the unbroken run from 1, up to the first missing one or the end of the file;
  a last line cut short is ignored. `LogReader.end` says where and why it
  stopped, on one line. A log still being written is read as it was when the
  reader opened it: what its run writes meanwhile is not read, so a run that
  logs faster than replay reads does not keep the reader going.

A closed log ends with the mail its run sent and never delivered (`in_flight`
lines, right before the end line): `LogReader.in_flight` once read to the end.
A delivery or fault line after them is damage.

Damage (a changed, lost, repeated or reordered line, a malformed field, a
missing delivery in a closed log, a line of more than `LINE_BYTES_MAX` bytes)
raises `ReplayLogError` naming the path and the line.
"""

from __future__ import annotations

import binascii
import heapq
import os
import stat
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from hicache.messages import ActorName, CodecError, Message, decode, encode
from hicache.messages.config import Config, ConfigError, DeviceKind

from ._log import LOG_VERSION, SEAL_BYTES, crc32, loads_line, unbase64

HEADER_BYTES_MAX = 1 << 20
"""Longest first line read: a header is a few kilobytes; a file with no newline this early
(`/dev/zero`, a binary file) is not a delivery log."""
LINE_BYTES_MAX = 1 << 30
"""Longest line read: a blob of the largest payload a run can log is far below it."""
REORDER_BYTES_MAX = 128 << 20
"""Bytes of deliveries held while one before them has not come (each counted as its line,
the blobs it refers to and `DELIVERY_BYTES`). A log whose next delivery has not come
within this many bytes of later ones lacks it."""
DELIVERY_BYTES = 512
"""What a held delivery costs beyond its bytes (its objects)."""

REPLAYED = (ActorName.TREE, ActorName.DEVICE, ActorName.HOST, ActorName.WRITE, ActorName.LOAD)
"""The actors replay rebuilds: all but the prefetcher (storage is not in the log)."""


class ReplayLogError(ValueError):
    """The log cannot be replayed: the message names the line and what is wrong."""


@dataclass(frozen=True, slots=True)
class Delivery:
    seq: int
    t: float
    receiver: ActorName
    sender: ActorName
    message: Message | None
    """The message (None only when its run could not encode it: see `unencodable`)."""
    ask: bool
    reply: bytes | None
    """The reply's msgpack bytes (`encode(reply)`), for an ask that returned one."""
    error: str | None
    line: int
    body: bytes = b""
    """The message's msgpack bytes (`encode(message)`; empty for a delivery not read from a log)."""
    answer: Message | None = None
    """The reply, decoded (None where `reply` is)."""
    faults: tuple[tuple[str, Any], ...] = ()
    """The fault plan's decisions (hook, value) the receiver took while handling it, in order."""
    unencodable: str | None = None
    """`body: ...` or `reply: ...`: the part its run could not encode, and why."""
    type_name: str = ""
    """The message's class name, as the line has it."""


@dataclass(frozen=True, slots=True)
class InFlight:
    """A message its run sent and never delivered: an `in_flight` line of a closed log."""

    receiver: ActorName
    sender: ActorName
    message: Message | None
    """The message (None only when its run could not encode it: see `unencodable`)."""
    ask: bool
    line: int
    body: bytes = b""
    """The message's msgpack bytes (`encode(message)`; empty where it is None)."""
    unencodable: str | None = None
    """`body: ...`: why its run could not encode it."""
    type_name: str = ""
    """The message's class name, as the line has it."""


@dataclass(frozen=True, slots=True)
class LogEnd:
    """How a log read to its end ended."""

    complete: bool
    """It has its end line: its run closed it."""
    last_seq: int
    """The last delivery given: of the unbroken run from 1."""
    note: str
    """For a log that is not complete, one line: where and why its deliveries stop."""


@dataclass(frozen=True, slots=True)
class RunHeader:
    """What replay takes from a log's header, checked."""

    config: Config
    """The logged `Config`, to rebuild on CPU (the KV bytes are not replayed) with no log."""
    seed: int
    stand_ins: frozenset[ActorName]
    replayed: tuple[ActorName, ...]
    """The actors replay rebuilds: `REPLAYED` less the stand-ins."""
    where: str = ""
    """The path and line of the header, for errors found when the actors are rebuilt."""


class Blobs(Mapping[int, bytes]):
    """The blobs a log's next delivery line may refer to, by number: those of the `blob`
    lines read so far, less the oldest past the writer's bound, forgotten (`trim`) after
    each delivery line as the writer did. It counts the lookups the codec makes, so that a
    body that referred to a blob is known (and re-encoded whole for comparisons)."""

    def __init__(self, held_bytes_max: int) -> None:
        self._data: dict[int, bytes] = {}
        self.held_bytes = 0
        self.held_bytes_max = held_bytes_max
        self._next = 0
        self.lookups = 0
        self.looked_up_bytes = 0

    def add(self, where: str, rec: dict[str, Any]) -> None:
        """Hold the blob of the log line `rec` (`where`: the path and line, for errors)."""
        try:
            number, data = rec["blob"], unbase64(rec["data"])
        except KeyError as err:
            raise ReplayLogError(f"{where}: blob without field {err}") from None
        except (binascii.Error, ValueError, TypeError) as err:
            raise ReplayLogError(f"{where}: corrupt blob: {err}") from None
        if number != self._next or isinstance(number, bool):
            raise ReplayLogError(f"{where}: blob number {number!r} where {self._next} was next")
        self._next += 1
        self._data[number] = data
        self.held_bytes += len(data)

    def trim(self) -> None:
        data = self._data
        while self.held_bytes > self.held_bytes_max:
            self.held_bytes -= len(data.pop(next(iter(data))))

    def __getitem__(self, number: int) -> bytes:
        data = self._data[number]
        self.lookups += 1
        self.looked_up_bytes += len(data)
        return data

    def __iter__(self) -> Iterator[int]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


_ACTORS = {a.value: a for a in ActorName}


class LogReader:
    """An open delivery log. Iterate it once for its deliveries in `seq` order; `end` then
    says how the log ended. `run` is the header's part replay needs, checked when first
    asked (a log written by the logging bench has none). Close it, or use it as a context
    manager."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file: BinaryIO = self.path.open("rb")
        except OSError as err:
            raise ReplayLogError(f"{self.path}: cannot read: {err.strerror}") from None
        self.bytes_read = 0
        """Bytes of the file read so far (for a progress bar)."""
        info = os.fstat(self._file.fileno())
        self.size: int | None = info.st_size if stat.S_ISREG(info.st_mode) else None
        """Bytes the reader reads: the file's size when it was opened (None for a pipe: to its end)."""
        self.end: LogEnd | None = None
        """How the log ended, once iterated to the end; None before."""
        self.in_flight: list[InFlight] = []
        """The mail its run sent and never delivered (the `in_flight` lines), complete once
        iterated to the end."""
        try:
            self.header = self._read_header()
        except BaseException:
            self._file.close()
            raise
        self._blobs = Blobs(self.header["blobs_held_bytes_max"])
        self._run: RunHeader | None = None
        self._iterated = False

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def _left(self, most: int) -> int:
        """At most `most` bytes, and none past `size`."""
        return most if self.size is None else min(most, self.size - self.bytes_read)

    def _error(self, n: int, what: str) -> ReplayLogError:
        return ReplayLogError(f"{self.path}: line {n}: {what}")

    # -- the header ----------------------------------------------------------------------------

    def _read_header(self) -> dict[str, Any]:
        try:
            raw = self._file.readline(self._left(HEADER_BYTES_MAX + 1))
        except OSError as err:
            raise ReplayLogError(f"{self.path}: cannot read: {err.strerror}") from None
        self.bytes_read += len(raw)
        if not raw:
            raise self._error(1, "the log is empty")
        if not raw.endswith(b"\n"):
            if len(raw) > HEADER_BYTES_MAX:
                raise self._error(1, f"no line end in its first {HEADER_BYTES_MAX} bytes: not a delivery log")
            raise self._error(1, "the header line is cut short: the log holds nothing to replay")
        line = raw[:-1]
        at = len(line) - SEAL_BYTES
        if line[at:at + 8] == b',"crc":"' and line[-2:] == b'"}':  # sealed (version 3 on): damage is damage
            self._unseal(1, line)
        header = self._json(1, line)
        if header.get("event") != "header":
            raise self._error(1, f"expected the header line, found {header.get('event')!r}")
        version = header.get("version")
        if version != LOG_VERSION:
            versions = header.get("versions")
            wrote = versions.get("hicache", "unknown") if isinstance(versions, dict) else "unknown"
            raise self._error(1, f"log version {version!r} is not supported (this hicache reads version "
                                 f"{LOG_VERSION}; replay it with the hicache that wrote it, {wrote})")
        self._unseal(1, raw[:-1])
        self._numbered(1, header)
        bound = header.get("blobs_held_bytes_max")
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
            raise self._error(1, f"header field blobs_held_bytes_max must be a byte count, got {bound!r}")
        return header

    @property
    def run(self) -> RunHeader:
        """The header's config, seed and stand-ins, checked; `ReplayLogError` names a bad field."""
        if self._run is None:
            self._run = _run_header(self.header, lambda what: self._error(1, what), f"{self.path}: line 1")
        return self._run

    # -- lines ---------------------------------------------------------------------------------

    def _json(self, n: int, raw: bytes) -> dict[str, Any]:
        try:
            rec = loads_line(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise self._error(n, f"not a JSON object ({err})") from None
        if not isinstance(rec, dict):
            raise self._error(n, "not a JSON object")
        return rec

    def _unseal(self, n: int, raw: bytes) -> None:
        """Check line `n`'s checksum (its number is checked once it is parsed: `_numbered`)."""
        at = len(raw) - SEAL_BYTES
        if b',"crc":"%08x"}' % crc32(raw[:at]) != raw[at:]:
            if raw[at:at + 8] != b',"crc":"' or raw[-2:] != b'"}':
                raise self._error(n, "the line has no checksum at its end (damaged, or not written by hicache)")
            raise self._error(n, "checksum mismatch: the line was changed or damaged")

    def _numbered(self, n: int, rec: dict[str, Any]) -> None:
        """Line `n`, parsed as `rec`, carries its number."""
        found = rec.get("n")
        if found != n or type(found) is not int:
            if isinstance(found, int) and found > n:
                raise self._error(n, f"the line is numbered {found}: {found - n} line(s) before it are missing")
            raise self._error(n, f"the line is numbered {found!r}: it is repeated or out of place")

    def _lines(self, n: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """Each line from line `n` on, checked and parsed, with its number; a last line with no
        line end is left out (`self._cut` is its number)."""
        readline, unseal = self._file.readline, self._unseal
        while True:
            try:
                raw = readline(self._left(LINE_BYTES_MAX + 1))
            except OSError as err:
                raise self._error(n, f"cannot read: {err.strerror}") from None
            if not raw:
                return
            self.bytes_read += len(raw)
            if raw[-1] != 0x0A:
                if len(raw) > LINE_BYTES_MAX:
                    raise self._error(n, f"longer than {LINE_BYTES_MAX} bytes (damaged: no line end)")
                self._cut = n
                return
            raw = raw[:-1]
            unseal(n, raw)
            try:
                rec = loads_line(raw)
            except (ValueError, UnicodeDecodeError) as err:
                raise self._error(n, f"not a JSON object ({err})") from None
            if type(rec) is not dict or rec.get("n") != n:
                self._numbered(n, self._json(n, raw))
            yield n, rec
            n += 1

    # -- deliveries ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Delivery]:
        if self._iterated:
            raise RuntimeError("a LogReader is read once; open the log again to read it again")
        self._iterated = True
        return self._deliveries()

    def _deliveries(self) -> Iterator[Delivery]:
        self._cut = 0
        held: list[tuple[int, int, Delivery]] = []  # (seq, cost, delivery): a heap by seq
        held_bytes = 0
        lines_of: dict[int, int] = {}  # seq -> line, of the held deliveries
        faults: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        blobs = self._blobs
        nxt = 1
        lines = self._lines(2)
        for n, rec in lines:
            event = rec.get("event")
            if self.in_flight and event in ("delivery", "fault"):
                raise self._error(n, f"a {event} line after the in-flight lines (from line {self.in_flight[0].line}), "
                                     "which only blob lines and the end line follow")
            if event == "delivery":
                before = blobs.looked_up_bytes
                receiver = rec.get("receiver")  # checked by `_delivery`; a malformed one takes no fault
                decided = faults.pop(receiver, None) if faults and isinstance(receiver, str) else None
                d = self._delivery(n, rec, tuple(decided) if decided else ())
                if blobs.held_bytes > blobs.held_bytes_max:
                    blobs.trim()
                if d.seq == nxt and not held:  # in order: most lines
                    nxt += 1
                    yield d
                    continue
                if d.seq < nxt or d.seq in lines_of:
                    first = lines_of.get(d.seq)
                    raise self._error(n, f"sequence number {d.seq} appears twice"
                                         + (f" (line {first})" if first else " (given already)"))
                cost = len(rec["body"] or "") + len(rec["reply"] or "") + blobs.looked_up_bytes - before \
                    + DELIVERY_BYTES
                heapq.heappush(held, (d.seq, cost, d))
                lines_of[d.seq] = n
                held_bytes += cost
                while held and held[0][0] == nxt:
                    _, cost, d = heapq.heappop(held)
                    del lines_of[nxt]
                    held_bytes -= cost
                    nxt += 1
                    yield d
                if held_bytes > REORDER_BYTES_MAX:
                    self._missing(lines, nxt, held)
                    return
            elif event == "blob":
                blobs.add(f"{self.path}: line {n}", rec)
            elif event == "fault":
                actor, hook = rec.get("actor"), rec.get("hook")
                if not isinstance(actor, str) or actor not in _ACTORS or not isinstance(hook, str) or "value" not in rec:
                    raise self._error(n, f"malformed fault line (actor {actor!r}, hook {hook!r})")
                faults[actor].append((hook, rec["value"]))
            elif event == "in_flight":
                self.in_flight.append(self._in_flight(n, rec))
                if blobs.held_bytes > blobs.held_bytes_max:
                    blobs.trim()
            elif event == "end":
                self._closed_log(n, rec, nxt, held, faults, lines)
                return
            else:
                raise self._error(n, f"unknown event {event!r}")
        self.end = self._cut_log(nxt, held)

    def _missing(self, lines: Iterator[tuple[int, dict[str, Any]]], nxt: int,
                 held: list[tuple[int, int, Delivery]]) -> None:
        """Later deliveries have filled the reorder bound and `nxt` has not come: read the rest
        for its end line (checking every line), which makes the gap damage; without one the
        log stops before the gap."""
        for m, rec in lines:
            if rec.get("event") == "end":
                first = min(held)
                raise self._error(first[2].line, f"delivery {first[0]} is here but delivery {nxt} is missing from "
                                                 f"the log (it is not within {REORDER_BYTES_MAX} bytes of lines "
                                                 f"after it; the end line is line {m})")
        self.end = self._cut_log(nxt, held)

    def _closed_log(self, n: int, rec: dict[str, Any], nxt: int, held: list[tuple[int, int, Delivery]],
                    faults: dict[str, list[tuple[str, Any]]], lines: Iterator[tuple[int, dict[str, Any]]]) -> None:
        for m, _ in lines:
            raise self._error(m, f"a line after the end line (line {n})")
        if self._cut:
            raise self._error(self._cut, f"a line after the end line (line {n}), cut short")
        issued = rec.get("deliveries")
        if held:
            seq, _, d = min(held)
            raise self._error(d.line, f"delivery {seq} is here but delivery {nxt} is missing from the log")
        if issued != nxt - 1:
            raise self._error(n, f"the end line counts {issued!r} deliveries, the log has {nxt - 1}")
        left = sorted(actor for actor, asked in faults.items() if asked)
        if left:
            raise self._error(n, f"fault lines of {', '.join(left)} after its last delivery line")
        self.end = LogEnd(True, nxt - 1, "")

    def _cut_log(self, nxt: int, held: list[tuple[int, int, Delivery]]) -> LogEnd:
        notes = [("the log has no end line (its run did not close it: it crashed, was killed, is running, or "
                  "could not write it: a full disk)")]
        if self._cut:
            notes.append(f"its last line, {self._cut}, is cut short")
        if held:
            notes.append(f"delivery {nxt} is missing and the {len(held)} after it are left out")
        return LogEnd(False, nxt - 1, "; ".join(notes))

    def _delivery(self, n: int, rec: dict[str, Any], faults: tuple[tuple[str, Any], ...]) -> Delivery:
        blobs = self._blobs
        try:
            seq, ask, error, unencodable = rec["seq"], rec["ask"], rec["error"], rec.get("unencodable")
            type_name = rec["type"]
            if type(seq) is not int or seq < 1:
                raise ValueError(f"seq {seq!r} is not a positive integer")
            if type(ask) is not bool or type(type_name) is not str or not (error is None or type(error) is str) \
                    or not (unencodable is None or type(unencodable) is str):
                raise ValueError("ask, type, error or unencodable has the wrong type")
            receiver, sender = _ACTORS.get(rec["receiver"]), _ACTORS.get(rec["sender"])
            if receiver is None or sender is None:
                raise ValueError(f"{rec['receiver']!r} or {rec['sender']!r} is not an actor name")
            message = answer = reply = None
            body = b""
            if rec["body"] is not None or unencodable is None or not unencodable.startswith("body"):
                before = blobs.lookups
                body = unbase64(rec["body"])
                message = decode(body, blobs)
                if type(message).__name__ != type_name:
                    raise ValueError(f"the body is a {type(message).__name__}, the line says {type_name!r}")
                if blobs.lookups != before:
                    body = encode(message)
            if rec["reply"] is not None:
                before = blobs.lookups
                reply = unbase64(rec["reply"])
                answer = decode(reply, blobs)
                if blobs.lookups != before:
                    reply = encode(answer)
            return Delivery(seq, float(rec["t"]), receiver, sender, message, ask, reply, error, n, body, answer,
                            faults, unencodable, type_name)
        except KeyError as err:
            raise self._error(n, f"delivery without field {err}") from None
        except (CodecError, binascii.Error, ValueError, TypeError) as err:
            raise self._error(n, f"corrupt delivery: {err}") from None

    def _in_flight(self, n: int, rec: dict[str, Any]) -> InFlight:
        try:
            ask, unencodable, type_name = rec["ask"], rec.get("unencodable"), rec["type"]
            if type(ask) is not bool or type(type_name) is not str \
                    or not (unencodable is None or type(unencodable) is str):
                raise ValueError("ask, type or unencodable has the wrong type")
            receiver, sender = _ACTORS.get(rec["receiver"]), _ACTORS.get(rec["sender"])
            if receiver is None or sender is None:
                raise ValueError(f"{rec['receiver']!r} or {rec['sender']!r} is not an actor name")
            if rec["body"] is None:
                if unencodable is None:
                    raise ValueError("no body, and no unencodable saying why")
                return InFlight(receiver, sender, None, ask, n, b"", unencodable, type_name)
            before = self._blobs.lookups
            body = unbase64(rec["body"])
            message = decode(body, self._blobs)
            if type(message).__name__ != type_name:
                raise ValueError(f"the body is a {type(message).__name__}, the line says {type_name!r}")
            if self._blobs.lookups != before:
                body = encode(message)
            return InFlight(receiver, sender, message, ask, n, body, None, type_name)
        except KeyError as err:
            raise self._error(n, f"in-flight line without field {err}") from None
        except (CodecError, binascii.Error, ValueError, TypeError) as err:
            raise self._error(n, f"corrupt in-flight line: {err}") from None


def _run_header(header: dict[str, Any], error: Any, where: str) -> RunHeader:
    """The header's fields replay needs, each checked (`error(what)` makes the exception)."""
    seed = header.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise error(f"header field seed must be an integer, got {seed!r}")
    for name in ("versions", "config", "actor_classes"):
        if not isinstance(header.get(name), dict):
            raise error(f"header field {name} must be a JSON object, got {header.get(name)!r}")
    if not isinstance(header.get("runtime"), str):
        raise error(f"header field runtime must be a string, got {header.get('runtime')!r}")
    stand_ins = header.get("stand_ins")
    if not isinstance(stand_ins, list) or any(name not in _ACTORS for name in stand_ins) \
            or len(set(stand_ins)) != len(stand_ins):
        raise error(f"header field stand_ins must be a list of distinct actor names, got {stand_ins!r}")
    stood_in = frozenset(_ACTORS[name] for name in stand_ins)
    replayed = tuple(a for a in REPLAYED if a not in stood_in)
    if not replayed:
        raise error(f"stand_ins names every actor replay rebuilds ({', '.join(a.value for a in REPLAYED)}): "
                    "nothing of this run can be replayed")
    try:
        # A log written before `storage_batch_mb` existed read in steps of `storage_batch_pages` exactly.
        config = Config.from_mapping({"storage_batch_mb": 0, **header["config"], "log_path": ""}).replace(
            device=DeviceKind.CPU.value)
    except (ConfigError, TypeError, ValueError) as err:
        raise error(f"the logged config is not valid: {err}") from None
    return RunHeader(config, seed, stood_in, replayed, where)


@dataclass(slots=True)
class ParsedLog:
    """A whole log read into memory (`read_log`): for a small log, or one replayed many times."""

    header: dict[str, Any]
    run: RunHeader
    deliveries: list[Delivery]
    end: LogEnd
    in_flight: list[InFlight] = field(default_factory=list)
    """The mail its run sent and never delivered (`LogReader.in_flight`)."""

    @property
    def config(self) -> Config:
        return self.run.config


def read_log(path: str | Path) -> ParsedLog:
    """Every delivery of a log, in `seq` order, held in memory (`LogReader` streams instead)."""
    with LogReader(path) as reader:
        run = reader.run
        deliveries = list(reader)
        assert reader.end is not None
        return ParsedLog(reader.header, run, deliveries, reader.end, reader.in_flight)
