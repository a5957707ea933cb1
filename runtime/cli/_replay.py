"""`hicache replay LOG`: replay a delivery log and point at the first divergence."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from hicache.messages import ActorName, HostSlotState

from .._log_reader import REPLAYED, LogReader, ReplayLogError
from ..testing._replay import ReplayResult, replay_log

DUMPS = ("tree", "device", "host", "ledger")


def run_replay(path: Path, *, until: int | None, actor: str | None, dump: str | None, as_json: bool) -> int:
    """Replay the log at `path`, streamed; print the outcome. 0: no divergence (up to where the log
    or `until` stops), 1: a divergence, 2: the log cannot be replayed (one line on stderr)."""
    replayable = tuple(a.value for a in REPLAYED)
    if actor is not None and actor not in replayable:
        return _refuse(f"--actor {actor!r} cannot be replayed; use one of {', '.join(replayable)}")
    try:
        with LogReader(path) as log:
            run = log.run
            only = ActorName(actor) if actor else None
            if only is not None and only not in run.replayed:
                return _refuse(f"--actor {actor}: that actor was a stand-in in the logged run (its header's "
                               f"stand_ins); replay one of {', '.join(a.value for a in run.replayed)}")
            result = _replay(log, until, only)
    except ReplayLogError as e:
        return _refuse(str(e))
    _print(result, _dump(result.actors, dump) if dump else None, as_json)
    return 0 if result.divergence is None else 1


def _refuse(what: str) -> int:
    print(f"hicache replay: {what}", file=sys.stderr)
    return 2


def _replay(log: LogReader, until: int | None, only: ActorName | None) -> ReplayResult:
    err = Console(stderr=True)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("replaying", total=log.size)
        return replay_log(log, until=until, only=only, progress=lambda n: bar.update(task, completed=log.bytes_read))


def _print(result: ReplayResult, dumped: str | None, as_json: bool) -> None:
    div = result.divergence
    if as_json:
        out: dict[str, Any] = {"deliveries": result.deliveries, "last_seq": result.last_seq,
                               "stopped": result.stopped, "divergence": None, "dump": dumped}
        if div is not None:
            out["divergence"] = {"seq": div.seq, "actor": div.actor, "expected": div.expected,
                                 "actual": div.actual, "context": div.context}
        print(json.dumps(out))
        return
    # plain print: outlines and messages must not be wrapped
    if dumped is not None:
        print(dumped)
    if div is None:
        where = f", up to delivery {result.last_seq}: {result.stopped}" if result.stopped else ""
        print(f"replayed {result.deliveries} deliveries, no divergence{where}")
        return
    print(f"divergence at delivery {div.seq} ({div.actor}):")
    print(f"  expected: {div.expected}")
    print(f"  actual:   {div.actual}")
    if div.context:
        print("  before it:")
        for line in div.context:
            print(f"    {line}")


def _dump(actors: dict[str, Any], what: str) -> str:
    if what == "tree":
        tree = actors.get("tree")
        if tree is None:
            return "(the tree was not replayed)"
        return tree_outline(tree.core)
    if what in ("device", "ledger"):
        dev = actors.get("device")
        if dev is None:
            return "(the device allocator was not replayed)"
        core = dev.core
        if what == "device":
            counts = core.counts()
            return "device slots: " + ", ".join(f"{o.name.lower()} {n}" for o, n in counts.items())
        views = [core.ledger(rid) for rid in sorted(core._ledgers)]
        lines = [f"{v.request_id}: allocated {v.allocated}, committed {v.committed}, given {v.freed}" for v in views]
        return "live ledgers:\n" + ("\n".join("  " + x for x in lines) if lines else "  (none)")
    host = actors.get("host")
    if host is None:
        return "(the host pool was not replayed)"
    counts = host.core.counts()
    return "host slots: " + ", ".join(f"{s.name.lower()} {counts[s]}" for s in HostSlotState)


def tree_outline(core: Any) -> str:
    """The tree as an indented outline: tokens, state, lock ref, host pins, hits."""
    lines = []
    tree = core.tree
    for root in tree.roots():
        lines.append(f"namespace {root.namespace!r}")
        stack = [(c, 1) for c in sorted(root.children.values(), key=lambda n: n.id, reverse=True)]
        while stack:
            node, depth = stack.pop()
            head = node.token_ids()[:4]
            lines.append(f"{'  ' * depth}#{node.id} {node.tokens} tokens {head}... {node.state.value} "
                         f"lock={node.lock_ref} host_ref={node.host_ref} hits={node.hit_count}")
            stack.extend((c, depth + 1) for c in sorted(node.children.values(), key=lambda n: n.id, reverse=True))
    s = tree
    lines.append(f"nodes {s.nodes}, device {s.device_tokens}, host {s.host_tokens}, "
                 f"protected {s.protected_tokens}, evictable {s.evictable_tokens}")
    return "\n".join(lines)
