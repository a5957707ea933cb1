"""Programmer errors the cores raise. Each message names the broken invariant."""


class InvariantError(AssertionError):
    """An invariant of a core does not hold (found by `check_invariants()`)."""


class LedgerError(RuntimeError):
    """A request's slot ledger was misused: allocate after release, commit beyond
    allocation, release twice, a slot that is not the request's (the ledger of SGLang #12224)."""


class SlotStateError(RuntimeError):
    """A slot was moved in a way its state machine forbids (double free,
    free while in flight, an illegal transition)."""
