"""Stop strings, matched on the generated text as it streams in (the engine stops on token ids only).

Text is released as soon as it cannot be the start of a stop string: only a tail that is a prefix of some stop
string is held back until the next piece decides it, so a stop string split across engine steps still matches and
never reaches the client, and text without such a tail streams with no delay. Generation stops at the first stop
string to be complete, as it would one token at a time, and the text is cut where that string starts.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = tuple(s for s in stops if s)
        self.held = ""  # generated text not yet released: a possible start of a stop string

    def feed(self, text: str) -> tuple[str, bool]:
        """(text to release now, whether a stop string matched); after a match the text is cut before it."""
        pending = self.held + text
        # The stop string completed first wins (then the longer one): how the text happens to be split into
        # engine steps cannot change the answer.
        hits = [(i + len(s), i) for s, i in ((s, pending.find(s)) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return pending[:min(hits)[1]], True
        keep = self._tail_to_hold(pending)
        self.held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep], False

    def flush(self) -> str:
        """The held-back tail, released when generation ended without a match."""
        held, self.held = self.held, ""
        return held

    def _tail_to_hold(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
