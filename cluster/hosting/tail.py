"""Reading a growing file line by line: a rank's output and its events, as its node actor tails them."""

from __future__ import annotations

__all__ = ["MAX_LINE", "MAX_READ", "Tail"]


# A rank's output is read at most this much per poll, and a line longer than MAX_LINE is cut
# (the rest of it skipped up to its newline): a 100 MB line or a progress bar that only ever
# writes carriage returns keeps this actor's and the driver's memory bounded.
MAX_READ = 4 * 2**20
MAX_LINE = 64 * 2**10


class Tail:
    """Reads the complete lines a growing file gained since the last call.

    A carriage return starts the line over, as on a terminal (a tqdm bar shows its last state).
    ``max_line=None`` never cuts (the runner's own event lines)."""

    def __init__(self, path: str, max_line: int | None = MAX_LINE) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.max_line = max_line
        self.skipping = False  # inside a line already cut: drop bytes up to its newline

    def read(self, final: bool = False) -> list[str]:
        """The lines since the last call: at most MAX_READ bytes' worth, or all of it when ``final``."""
        out: list[bytes] = []
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                while True:
                    data = f.read(MAX_READ if self.max_line else -1)
                    self.offset += len(data)
                    self._feed(data, out)
                    if not final or not self.max_line or len(data) < MAX_READ:
                        break
        except FileNotFoundError:
            return []
        if final and self.partial:
            out.append(self._shape(self.partial))
            self.partial = b""
        return [line.decode("utf-8", "replace") for line in out]

    def _feed(self, data: bytes, out: list[bytes]) -> None:
        pieces = data.split(b"\n")
        tail = pieces.pop()  # not ended by a newline yet
        for piece in pieces:
            line, skipped = self.partial + piece, self.skipping
            self.partial, self.skipping = b"", False
            if not skipped:  # else: the end of a line already given, cut
                out.append(self._shape(line))
        if not self.skipping:
            self.partial = self.partial + tail
            if self.max_line:
                self.partial = self._last_segment(self.partial)
                if len(self.partial) > self.max_line:
                    out.append(self._shape(self.partial))
                    self.partial, self.skipping = b"", True

    def _last_segment(self, line: bytes) -> bytes:
        """What a terminal shows of a line rewritten with carriage returns."""
        cut = line.rfind(b"\r", 0, len(line) - 1) if line.endswith(b"\r") else line.rfind(b"\r")
        return line[cut + 1:] if cut >= 0 else line

    def _shape(self, line: bytes) -> bytes:
        if not self.max_line:
            return line
        line = self._last_segment(line)
        if len(line) > self.max_line:
            line = line[: self.max_line] + f" ... [line cut at {self.max_line} bytes]".encode()
        return line
