"""Handing a buffer that engines keep inside themselves between the methods that touch it."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..errors import RunError
from .interpreter import LoadedDelegate


class Handover:
    """Where the current value of each buffer an engine keeps inside itself lives, and its moves between methods.

    A kept buffer's value is either in its shared memory (``HOST``) or in the engine of one
    delegate. Before a method runs (``claim``), each buffer it touches is moved to where that
    method reads it: stored by the engine that holds it, then loaded by the one that keeps it in
    this method. Methods that share a cache (prefill, then decode) move it once per switch, not
    once per call; the calls of one method in a row move nothing. Every move runs under the
    program's state lock.
    """

    def __init__(self, release: Callable[[Iterable[str]], None]) -> None:
        # Lets the host memory of buffers an engine now holds leave memory.
        self.release = release
        self.keepers: dict[str, LoadedDelegate] = {}
        # Per method, each buffer it touches and the delegate that keeps it there (None: the host).
        self.places: dict[str, dict[str, str | None]] = {}
        # Per kept buffer, the delegate whose engine holds its current value; absent: the host.
        self.live: dict[str, str] = {}
        self.last_method: str | None = None

    def add_keeper(self, method: str, reader: str, loaded: LoadedDelegate, kept: frozenset[str]) -> None:
        """Delegate ``reader`` of ``method`` keeps ``kept`` inside its engine."""
        self.keepers[reader] = loaded
        self.places.setdefault(method, {}).update(dict.fromkeys(kept, reader))

    def add_method(self, name: str, touched: set[str]) -> None:
        """Method ``name`` reads or updates ``touched``: on the host, except what a keeper of it holds."""
        places = self.places.setdefault(name, {})
        for fqn in touched:
            places.setdefault(fqn, None)

    def kept(self) -> set[str]:
        return {fqn for where in self.keepers_by_method().values() for fqn in where}

    def keepers_by_method(self) -> dict[str, dict[str, str]]:
        """Per method, each buffer a delegate's engine keeps inside itself there -> that delegate (``method/id``)."""
        kept = {
            name: {fqn: reader for fqn, reader in places.items() if reader is not None}
            for name, places in self.places.items()
        }
        return {name: where for name, where in kept.items() if where}

    def settled(self) -> None:
        """Drop what needs no handing over: methods and buffers no engine keeps."""
        kept = self.kept()
        places = {name: {fqn: at for fqn, at in where.items() if fqn in kept} for name, where in self.places.items()}
        self.places = {name: where for name, where in places.items() if where}

    def claim(self, method: str) -> None:
        """Move each kept buffer ``method`` touches to where it reads it."""
        if self.last_method == method:
            return
        stores: dict[str, list[str]] = {}
        loads: dict[str, list[str]] = {}
        for fqn, reader in self.places.get(method, {}).items():
            holder = self.live.get(fqn)
            if holder == reader:
                continue
            if holder is not None:
                stores.setdefault(holder, []).append(fqn)
            if reader is not None:
                loads.setdefault(reader, []).append(fqn)
        for holder, fqns in stores.items():
            self.engine_moves(holder, "store_state", fqns)
            for fqn in fqns:
                del self.live[fqn]
        for reader, fqns in loads.items():
            self.engine_moves(reader, "load_state", fqns)
            self.live.update(dict.fromkeys(fqns, reader))
            self.release(fqns)
        self.last_method = method

    def engine_moves(self, reader: str, hook: str, fqns: list[str]) -> None:
        """Call the run side's ``hook`` (``store_state`` or ``load_state``) of delegate ``reader`` on ``fqns``."""
        keeper = self.keepers[reader]
        try:
            getattr(keeper.runtime, hook)(keeper.handle, fqns)
        except Exception as exc:
            # Where the values are now is unknown: the next call of any method moves them again.
            self.last_method = None
            raise RunError(f"delegate {reader}: {hook} of {', '.join(fqns)} failed: {exc}") from exc

    def reset(self) -> None:
        """The shared memory now holds every buffer's value again (``reset()`` rewrote it)."""
        self.live.clear()
        self.last_method = None
