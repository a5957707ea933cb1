"""The three packages keep their exports honest: an explicit `__all__` whose names
exist, and every public class or function of their private modules either exported
or listed below as internal, with the reason."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import pytest

import hicache.actors
import hicache.messages
import hicache.runtime
from hicache.messages import ENUM_TYPES, MESSAGE_TYPES

PACKAGES = (hicache.actors, hicache.messages, hicache.runtime)

COMMAND_MODULES = ("_usage",)
"""Private modules of `hicache.runtime` that serve the `hicache` command (its usage errors);
the commands themselves are in `hicache.runtime.cli`, `demo` and `bench`."""

INTERNAL = {
    "hicache.messages._doc.main": "the command that writes docs/messages.md (`python -m hicache.messages._doc`)",
    "hicache.messages._doc.page": "docs/messages.md as the message classes make it; the docs test compares",
    "hicache.messages._registry.frozen_fast_init": "how @message and the facade's frozen records get their __init__",
    "hicache.messages._index.viewed": "the slice rule that Indices slices, node keys and the facade's commits share",
    "hicache.runtime._lazy.lazy_exports": "the PEP 562 exports of hicache.runtime and hicache.runtime.demo",
    "hicache.runtime._group.agree": "the facade's tagged all_min: every agreement says what it agrees on",
    "hicache.runtime._group.Agreement": "the tags of the facade's agreements",
    "hicache.runtime._group.agree_config": "the facade's check at start() that every rank of a group gives the "
                                           "same deciding Config fields",
    "hicache.runtime._kv_checks.LiveSlots": "the facade's record of the slots a forward pass may write and read "
                                            "(Config.check_kv_writes, check_kv_reads), which its DeviceKV checks",
    "hicache.actors._transfer_core.batch_indices": "stream actors' helper over a TransferQueue batch",
    "hicache.actors._transfer_core.op_problem": "stream actors' check of a WriteKV/LoadKV before queueing",
    "hicache.actors._kv.involves_cuda": "the copy route's and the streams' test of a CUDA buffer on either side",
    "hicache.actors._pages.ints": "the pool cores' choice of slot-number form (Python ints or a tensor) for a call",
    "hicache.actors._pages.as_list": "the pool cores' conversion of slot numbers of either form to Python ints",
    "hicache.actors._pages.as_tensor": "the pool cores' conversion of slot numbers of either form to a tensor",
    "hicache.actors._pages.indices_of": "the pool cores' conversion of slot numbers of either form to Indices",
    "hicache.actors._pages.new_pages": "the page count rule of an allocation, which the device grants by and the "
                                       "facade checks its grants against",
    "hicache.actors._pages.as_pages": "the pool cores' choice of page-number form (Python ints or an array) for a call",
    "hicache.actors._pages.pages_of_array": "the device core's page numbers of a ledger's array, in the form for their number",
    "hicache.actors._pages.pages_of_bytes": "the device core's page numbers of a grant's bytes, in the form for their number",
    "hicache.actors._pages.PageTable": "the pool cores' value per page (owner or state) with its checked moves",
    "hicache.actors._pages.SlotTable": "the facade's slot numbers of every device page, for its slot answers",
    "hicache.actors._radix_node.key_part": "the radix tree's cut of a node key (a view of most of a buffer, or a copy)",
    "hicache.actors._radix_node.first_page": "the radix tree's bytes a child is filed under",
    "hicache.actors._stored_page.Header": "a stored page header as read, for both storage backends' checks",
    "hicache.actors._stored_page.check_keys": "both storage backends' key check (page_keys makes valid keys)",
    "hicache.actors._stored_page.checksum": "both storage backends' XXH3-64 of a page's runs",
    "hicache.actors._stored_page.page_starts": "both storage backends' check of the host slots of a read or write",
    "hicache.actors._stored_page.Headers": "both storage backends' page headers of a batch, filled and compared",
    "hicache.actors._page_index.PageIndex": "the file backend's index of pages in segments",
    "hicache.actors._record_block.RecordBlock": "the file backend's batch of small page records for one write",
    "hicache.actors._segments.Segment": "the file backend's record of one segment file",
    "hicache.actors._segments.scan": "the file backend's scan of a segment's records",
    "hicache.actors._segments.segment_name": "the file backend's naming of its segment files",
    "hicache.actors._segments.is_segment": "the file backend's naming of its segment files",
    "hicache.actors._segments.writer_of": "the file backend's naming of its segment files",
    "hicache.actors._segments.seal_name": "the file backend's naming of its segment files",
    "hicache.actors._segments.sealed_segment": "the file backend's naming of its segment files",
    "hicache.actors._segments.blank": "the file backend's check that a finished segment holds no page",
    "hicache.actors._segments.punch": "the file backend's fallocate(PUNCH_HOLE) of an evicted record",
    "hicache.actors._segments.preadv_all": "the file backend's whole preadv of a run of records",
    "hicache.actors._segments.pwritev_all": "the file backend's whole pwritev of a batch of records",
    "hicache.actors._io_threads.IOThreads": "both storage backends' helper threads for the pieces of one large-page read",
    "hicache.actors._io_threads.shares": "both storage backends' split of a read's pages among its threads",
    "hicache.runtime.testing._mooncake_master.master_binary": "MooncakeMaster's lookup of the mooncake_master executable",
    "hicache.messages._codec.BlobRefs": "protocol of encode's blob store; only the delivery log implements it",
    "hicache.runtime._log.LogInUseError": "the log writer's refusal of a file another instance holds; start() "
                                          "raises it as a ConfigError",
    "hicache.runtime._log.unbase64": "read_log's base64 decoding (pybase64 when installed), next to the encoding",
    "hicache.runtime._log.error_text": "the text of a handler's error, as the log writes it and replay compares it",
    "hicache.runtime._log_reader.Blobs": "the blobs a log being read may refer to, for LogReader",
    "hicache.runtime.testing._replay.Rebuilt": "the rebuilt actors of a log, for replay and the replay bench",
    "hicache.actors._services.Clock": "protocol of Services.clock; users get a clock from a runtime",
    "hicache.actors._services.MonotonicClock": "the threaded runtime's clock",
    "hicache.actors._services.Failures": "the runtime's record of failed actors; System raises from it",
    "hicache.runtime._system.Runtime": "protocol System needs from a runtime; both runtimes are exported",
    "hicache.runtime._system.actor_specs": "the wiring of cores and actors shared by System.start and log replay",
    "hicache.runtime._inline_cores.InlineCores": "the cores without actors, shared by bench overhead's direct side "
    "and the simulator",
    "hicache.actors._facts.Agreement": "the tree core's part that owns Facts and applies agreed outcomes",
    "hicache.actors._radix_node.check_node": "the radix tree's check of one node's own invariants",
    "hicache.actors._radix_node.device_evictable": "the radix tree's eviction predicate for a device copy",
    "hicache.actors._radix_node.host_evictable": "the radix tree's eviction predicate for a host-only node",
    "hicache.actors._radix_node.differing_pages": "the radix tree's comparison of a request's pages with a node's",
    "hicache.actors._tree_admission.Admissions": "the tree core's part for admission, locks and release",
    "hicache.actors._tree_writes.WriteBack": "the tree core's part for write policy, write-back and eviction",
    "hicache.actors._tree_prefetch.PrefetchBook": "the tree core's part for storage prefetches",
    "hicache.actors._tree_holds.SettledHolds": "the prefetch book's host pins of settled pages for their requests",
    "hicache.actors._tree_backup.BackupBook": "the tree core's part for backups to storage",
    "hicache.actors._tree_shared.TreeShared": "the state the tree core's parts share",
    "hicache.actors._tree_shared.Counters": "the tree core's counters behind TreeStatistics",
    "hicache.actors._tree_shared.cat": "the tree core's parts' concatenation of optional page lists",
    "hicache.actors._logging.logger": "the operational log lines of storage and the facade, through stdlib logging",
    "hicache.runtime._calls.Interrupts": "the facade's deferral of SIGINT to the points where a call may give up",
    "hicache.runtime._calls.Pending": "the facade's journal entry of a call in flight",
    "hicache.runtime._facade_types.count": "the facade's check of a count argument",
    "hicache.runtime._facade_types.demands": "the facade's check of a {request: count} argument",
    "hicache.runtime._facade_types.namespace": "the facade's check of a namespace argument",
    "hicache.runtime._facade_types.seconds": "the facade's check of a timeout argument",
    "hicache.runtime._facade_types.switch": "the facade's check of a True/False argument",
    "hicache.runtime._facade_types.shown": "how the facade's and the KV API's errors name a value, on one line",
    "hicache.runtime._facade_types.request_id": "the facade's check of a request id argument",
    "hicache.runtime._facade_types.token_bytes": "the facade's check and conversion of token ids",
    "hicache.runtime._facade_types.prompt_continued": "the facade's comparison of a commit with the admitted prompt",
    "hicache.messages._config_values.Rule": "protocol of a Config field's rule; Config's field metadata holds them",
    "hicache.messages._config_values.Count": "a Config field's rule (integers in a range)",
    "hicache.messages._config_values.Number": "a Config field's rule (finite numbers in a range)",
    "hicache.messages._config_values.Switch": "a Config field's rule (true or false)",
    "hicache.messages._config_values.Choice": "a Config field's rule (an enum member or its value)",
    "hicache.messages._config_values.DType": "a Config field's rule (an element type of DTYPES)",
    "hicache.messages._config_values.FilePath": "a Config field's rule (a path string)",
    "hicache.messages._config_values.Host": "a Config field's rule (a host name or address)",
    "hicache.messages._config_values.HostPort": "a Config field's rule (host:port)",
    "hicache.messages._config_values.HttpUrl": "a Config field's rule (an http:// URL)",
    "hicache.messages._config_values.Name": "a Config field's rule (a short label value)",
    "hicache.messages._config_values.ModelId": "a Config field's rule (a model's name)",
    "hicache.messages._config_values.refuse": "the ConfigError of a value a rule refuses, for the rules and for_model",
    "hicache.messages._model_shape.ModelShape": "Config.for_model's reading of a model config",
    "hicache.messages._model_shape.model_shape": "Config.for_model's reading of a model config",
    "hicache.messages._model_shape.model_name": "Config.for_model's reading of a model config",
    "hicache.messages._resources.Need": "one allocation check_resources counts; its error message lists them",
    "hicache.messages._resources.needs": "the allocations check_resources counts",
    "hicache.messages._resources.host_available_bytes": "check_resources' reading of the machine's free host memory",
    "hicache.runtime._config_doc.field_table": "makes docs/configuration.md's field table (a test keeps it current)",
    "hicache.runtime._config_doc.with_table": "makes docs/configuration.md's field table (a test keeps it current)",
    "hicache.runtime._config_doc.main": "the command that rewrites docs/configuration.md's field table",
    "hicache.runtime.demo._tiny_model.incremental_drift": "the measurement behind the model tests' logit tolerance",
    "hicache.runtime.demo._tiny_model.measure_drift": "the measurement behind the model tests' logit tolerance",
    "hicache.runtime.demo._tiny_model.main": "the command that prints the measurement behind the logit tolerance",
    "hicache.runtime._metrics.track": "HiCache.start's registration of an instance with metrics on",
    "hicache.runtime._metrics.untrack": "HiCache.close's end of an instance's metrics",
    "hicache.runtime._timings.FacadeTimings": "HiCache's call and load-wait histograms, made only with metrics on",
    "hicache.runtime._statistics.cache_statistics": "HiCache.statistics' assembly of the tiers from the actors' records",
}
"""Public-looking names of private modules that are deliberately not exported.
Each entry needs a reason; a stale entry (the name is gone, or now exported) fails."""


def _private_modules(pkg: ModuleType) -> list[ModuleType]:
    found = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_") or info.name.startswith(COMMAND_MODULES):
            continue
        found.append(importlib.import_module(f"{pkg.__name__}.{info.name}"))
    return found


def _defined_public(module: ModuleType) -> list[str]:
    """Public classes and functions defined in `module` itself (not imported into it)."""
    return sorted(
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and getattr(obj, "__module__", None) == module.__name__
    )


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.__name__)
def test_each_package_has_an_explicit_all_whose_names_exist(pkg: ModuleType) -> None:
    assert "__all__" in vars(pkg), f"{pkg.__name__} has no __all__"
    names = list(pkg.__all__)
    assert names, f"{pkg.__name__}.__all__ is empty"
    assert len(names) == len(set(names)), f"{pkg.__name__}.__all__ lists a name twice"
    missing = [n for n in names if not hasattr(pkg, n)]
    assert not missing, f"{pkg.__name__}.__all__ names what the package does not define: {missing}"
    private = [n for n in names if n.startswith("_")]
    assert not private, f"{pkg.__name__}.__all__ exports private names: {private}"


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.__name__)
def test_star_import_gives_exactly_the_names_of_all(pkg: ModuleType) -> None:
    scope: dict[str, object] = {}
    exec(f"from {pkg.__name__} import *", scope)  # noqa: S102
    assert sorted(k for k in scope if k != "__builtins__") == sorted(pkg.__all__)


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.__name__)
def test_public_names_of_private_modules_are_exported_or_declared_internal(pkg: ModuleType) -> None:
    exported = {id(getattr(pkg, n)) for n in pkg.__all__}
    unexported = [
        f"{m.__name__}.{name}"
        for m in _private_modules(pkg)
        for name in _defined_public(m)
        if id(getattr(m, name)) not in exported and f"{m.__name__}.{name}" not in INTERNAL
    ]
    assert not unexported, (
        f"public names of private modules of {pkg.__name__} that are neither in __all__ nor in "
        f"INTERNAL (export them, rename them with an underscore, or list them with a reason): {unexported}"
    )


def test_every_internal_entry_still_names_an_unexported_definition() -> None:
    stale = []
    for dotted in INTERNAL:
        module_name, name = dotted.rsplit(".", 1)
        module = importlib.import_module(module_name)
        pkg = importlib.import_module(module_name.rsplit(".", 1)[0])
        if name not in _defined_public(module) or name in pkg.__all__:
            stale.append(dotted)
    assert not stale, f"INTERNAL entries that are gone or now exported: {stale}"


def test_every_message_record_and_wire_enum_is_exported_from_hicache_messages() -> None:
    registered = {c.__name__: c for c in MESSAGE_TYPES.values()} | {e.__name__: e for e in ENUM_TYPES.values()}
    missing = sorted(n for n in registered if n not in hicache.messages.__all__)
    assert not missing, f"registered but not exported from hicache.messages: {missing}"
    wrong = sorted(n for n, c in registered.items() if getattr(hicache.messages, n, None) is not c)
    assert not wrong, f"hicache.messages exports another object under these names: {wrong}"


def test_every_message_class_of_the_area_modules_is_registered() -> None:
    from hicache.messages import Message

    unregistered = []
    for area in ("common", "device", "host", "transfer"):
        module = importlib.import_module(f"hicache.messages.{area}")
        for name in _defined_public(module):
            obj = getattr(module, name)
            if issubclass(obj, Message) and MESSAGE_TYPES.get(getattr(obj, "TYPE_CODE", None)) is not obj:
                unregistered.append(f"{area}.{name}")
    assert not unregistered, f"message classes not declared with @message(code): {unregistered}"


def test_the_config_module_exports_its_public_names_through_hicache_runtime() -> None:
    import hicache.messages.config as config
    import hicache.runtime.config as where_users_import_it

    missing = [n for n in _defined_public(config) if n not in hicache.runtime.__all__]
    assert not missing, f"hicache.messages.config defines but hicache.runtime does not export: {missing}"
    moved = [n for n in config.__all__ if getattr(where_users_import_it, n) is not getattr(config, n)]
    assert not moved, f"hicache.runtime.config does not re-export these of hicache.messages.config: {moved}"
