"""Stop strings (OpenAI `stop`, `GenerateRequest.stop`), for every engine: generation ends before the
earliest occurrence of any stop string, the returned text excludes it, the finish reason is "stop".

Two layers, one implementation:

- `StopMatcher` works on text fed incrementally. It finds the earliest stop string, including one
  spread over several feeds (tokens), and says what text may be emitted now: everything except the
  tail that could still be the start of a stop string.
- `StopTokens` puts it on an engine's token stream: each output token goes through `push`, which
  decodes, matches, and returns the tokens that are safe to stream (`on_token`) and whether the
  request is done. Its `tokens` / `text` are the request's result, cut at the stop.

It lives in each engine's decode loop (not in `BackgroundEngine.generate/stream`): the loop must end
the request at the stop, so that no further decode step runs, and the serving replica streams
through `submit(on_token=...)`, past `generate` and `stream`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder writes for a character cut in the middle (more bytes to come)


class StopMatcher:
    """Earliest-stop-string search over text fed piece by piece.

    `feed(delta)` returns `(emit, stopped)`: `emit` is the text that became safe to emit (the text
    before a found stop string, or everything but the held-back tail); after a stop nothing more is
    accepted. `flush()` releases the held-back tail when generation ends without a stop. `text` is
    everything emitted so far, which after a stop (or a flush) is the whole result."""

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not one string")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._longest = max((len(s) for s in self.stops), default=0)
        self._buffer = ""  # all text fed
        self._emitted = 0  # text[:_emitted] is emitted; no stop string can start before it
        self.stopped = False

    @property
    def text(self) -> str:
        return self._buffer[:self._emitted]

    @property
    def emitted(self) -> int:
        """Characters emitted so far: the safe length of the text fed."""
        return self._emitted

    @property
    def fed(self) -> int:
        """Characters fed so far."""
        return len(self._buffer)

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            raise RuntimeError("the matcher already stopped")
        self._buffer += delta
        start = self._emitted
        found = [pos for pos in (self._buffer.find(s, start) for s in self.stops) if pos >= 0]
        if found:
            end = min(found)
            self.stopped = True
        else:
            end = len(self._buffer) - self._held_back(start)
        self._emitted = end
        return self._buffer[start:end], self.stopped

    def flush(self) -> str:
        """The held-back tail, at the end of a generation that did not stop on a stop string."""
        if self.stopped:
            return ""
        start, self._emitted = self._emitted, len(self._buffer)
        return self._buffer[start:]

    def _held_back(self, start: int) -> int:
        """Length of the longest suffix of the text (from `start`) that is a proper prefix of a stop
        string: it may still become one, so it is not emitted yet."""
        tail = self._buffer[max(start, len(self._buffer) - self._longest + 1):]
        for cut in range(len(tail)):
            suffix = tail[cut:]
            if any(s.startswith(suffix) for s in self.stops):
                return len(suffix)
        return 0


class StopTokens:
    """`StopMatcher` over an engine's output tokens, decoded with the engine's `decode(ids) -> str`.

    `push(token)` returns `(release, stopped)`: the tokens that became safe to stream (in order; every
    token is released once) and whether a stop string ended the generation. A token is released
    once all of its text is emitted, so a streaming client that decodes the released tokens never
    sees any part of a stop string. After a stop, `tokens` are the output tokens whose text lies
    wholly before the stop string and `text` is the output text up to it; when the stop string
    starts inside a token (multi-character tokens), that token is left out of `tokens` while its
    text before the stop stays in `text`. Without a stop, `finish()` releases the tokens still held
    back and `tokens` / `text` are the whole output. With no stop strings nothing is decoded here:
    each token is released as it comes. `on_release` (an engine's streaming callback) is called with
    every released token, in order."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str],
                 on_release: Callable[[int], None] | None = None) -> None:
        self.matcher = StopMatcher(stops)
        self._decode = decode
        self._on_release = on_release
        self._out: list[int] = []
        self._ends: list[int] = []  # text length each token's output prefix reaches
        self._released = 0
        self._kept: int | None = None  # tokens kept after a stop

    @property
    def active(self) -> bool:
        return bool(self.matcher.stops)

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    @property
    def tokens(self) -> list[int]:
        return self._out[:self._kept] if self._kept is not None else list(self._out)

    @property
    def text(self) -> str:
        """The output text: cut before the stop string after a stop, whole after `finish()`."""
        if not self.active:
            return self._decode(self._out)
        return self.matcher.text

    def push(self, token: int) -> tuple[list[int], bool]:
        if self.stopped:
            raise RuntimeError("generation already stopped")
        self._out.append(token)
        if not self.active:
            return self._release(len(self._out)), False
        decoded = self._decode(self._out)
        # a trailing replacement character is a character still being spelled out byte by byte:
        # match only the settled text, and count the token as reaching past it (held until it settles)
        settled = decoded.rstrip(REPLACEMENT)
        self._ends.append(len(decoded))
        self.matcher.feed(settled[self.matcher.fed:])
        return self._advance(), self.stopped

    def finish(self) -> list[int]:
        """The generation ended (length or end of sequence): release what is still held back."""
        if self.stopped:
            return []
        if self.active:  # what never settled (a character cut by the end) is text too: match it
            self.matcher.feed(self._decode(self._out)[self.matcher.fed:])
            if self.stopped:
                return self._advance()
            self.matcher.flush()
        return self._release(len(self._out))

    def _advance(self) -> list[int]:
        """Release the tokens whose text is all emitted; after a stop they are the ones kept."""
        upto = self._released
        while upto < len(self._out) and self._ends[upto] <= self.matcher.emitted:
            upto += 1
        if self.stopped:
            self._kept = upto
        return self._release(upto)

    def _release(self, upto: int) -> list[int]:
        released, self._released = self._out[self._released:upto], max(self._released, upto)
        for token in released if self._on_release is not None else ():
            self._on_release(token)
        return released
