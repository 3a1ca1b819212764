"""What an engine tells an observer (the metrics collector of `ferry.metrics`), and nothing else.

An engine holds a tuple of observers, empty unless a collector attached one. The engine's two hot
paths ask ``if self._observers:`` and do nothing more when it is empty: no clock is read, no
object is made and nothing is imported. An observer is called on the engine's trio thread, in
commit order, and must not block or raise (it only counts).
"""

from __future__ import annotations

from typing import Protocol

from ._values import Flow


class Observer(Protocol):
    def ran(
        self,
        flow: Flow,
        step: str,
        compensating: bool,
        result: object,
        error: BaseException | None,
        seconds: float,
        void: bool,
    ) -> None:
        """One attempt of a step (or of its compensation) of `flow` returned `result` or raised
        `error` after `seconds`; `void`: someone else moved the flow meanwhile (a cancel, a
        takeover) and the attempt counts for nothing."""

    def ended(self, flow: Flow) -> None:
        """This engine wrote `flow` COMPLETED, FAILED or BLOCKED."""
