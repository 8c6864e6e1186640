"""What a person sees while a job runs: a live bar on a terminal, plain lines elsewhere.

The driver states the run's course as typed events (``jobs.run.events``: an attempt began or ended, rank 0's
progress at most once a second): ``raylaunch run`` hands them to its ``ProgressView`` directly (``event``);
under ``raylaunch submit`` the driver runs on the cluster with a ``relay`` view that prints each as one
``raylaunch-event {json}`` line of the job's log, which the view of ``submit --follow`` decodes. No line of
prose is read back. Either way all other output passes through the same view:

- ``bar``: a tqdm bar (step of total, loss, samples/s, elapsed, remaining,
  attempt, restarts, world size); every other line prints above it;
- ``plain``: when the output is not a terminal (CI logs, files), one plain
  progress line every ``every_s`` seconds, never a carriage return;
- ``quiet``: no progress at all; every other line still prints;
- ``relay``: in a Ray job: every event as its line, for the view that follows the job.
"""

from __future__ import annotations

import time
from typing import TextIO

from cluster.protocol import Progress
from jobs.run.events import AttemptEnded, AttemptStarted, ProgressShown, Reserved, RunEvent, decode_line, encode_line

__all__ = ["ProgressView"]

# Ranks named by the driver's pace verdict (jobs/driver/pace.py): the ranks the others wait for, those starved for data.
PACE = ("straggler", "starved")


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ProgressView:
    """A text stream (``write``/``flush``) that turns progress lines into a bar or plain lines.

    >>> import io
    >>> out = io.StringIO()
    >>> view = ProgressView(out, "plain")
    >>> view.event(ProgressShown(time=0.0, step=5, values={"loss": "0.5", "total_steps": "10"}))
    >>> out.getvalue().startswith("raylaunch: step 5/10 (50%) loss=0.5")
    True
    """

    def __init__(self, out: TextIO, mode: str, every_s: float = 10.0) -> None:
        if mode not in ("bar", "plain", "quiet", "relay"):
            raise ValueError(f"mode must be bar, plain, quiet or relay, not {mode!r}")
        self.out, self.mode, self.every_s = out, mode, every_s
        self.attempt, self.restarts = 1, 0
        self.metrics: dict[str, str] = {}
        self.step: int | None = None
        self.total: int | None = None
        self.started = time.monotonic()
        self._rate_from: tuple[int, float] | None = None  # (step, time) where this attempt's steps began
        self._shown_step: int | None = None
        self._last_shown = 0.0
        self._pending = ""
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=None, unit="step", file=out, dynamic_ncols=True,
                             bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")

    @classmethod
    def for_stream(cls, out: TextIO, quiet: bool = False, relay: bool = False) -> "ProgressView":
        """``relay`` or ``quiet`` if asked, a bar on a terminal, plain lines otherwise."""
        if relay or quiet:
            return cls(out, "relay" if relay else "quiet")
        return cls(out, "bar" if getattr(out, "isatty", lambda: False)() else "plain")

    # --- a text stream --------------------------------------------------------------

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self.line(line)
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def line(self, text: str) -> None:
        """A line of output: an event's line (a followed job's) is taken as the event, any other is shown."""
        event = decode_line(text)
        if event is not None:
            self.event(event)
            return
        if self._bar is not None:
            self._bar.write(text, file=self.out)
        else:
            print(text, file=self.out, flush=True)

    def close(self) -> None:
        """Flush a partial line and, in plain mode, the latest progress if it was not shown."""
        if self._pending:
            self.line(self._pending)
            self._pending = ""
        if self.mode == "plain" and self.step is not None and self._shown_step != self.step:
            self._show_plain()
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # --- the run's events ----------------------------------------------------------------

    def event(self, e: RunEvent) -> None:
        """What the view keeps of an event: the attempt and restarts, the world size, progress."""
        if self.mode == "relay":
            print(encode_line(e), file=self.out, flush=True)
            return
        if isinstance(e, AttemptStarted):
            self.attempt, self.restarts = e.attempt, e.restarts
            self._rate_from = None
        elif isinstance(e, AttemptEnded):
            self.restarts = e.restarts
        elif isinstance(e, Reserved) and e.world_size:
            self.metrics["world_size"] = str(e.world_size)
        elif isinstance(e, ProgressShown) and e.step is not None:
            self.show(Progress(e.step, dict(e.values)))

    # --- progress ---------------------------------------------------------------------

    def show(self, progress: Progress) -> None:
        """Where training is: the bar moves, or a plain line is due."""
        now = time.monotonic()
        step = progress.step
        for key in PACE:  # said only while it holds
            self.metrics.pop(key, None)
        self.metrics.update(progress.values)
        if "total_steps" in self.metrics:
            try:
                self.total = int(float(self.metrics["total_steps"]))
            except ValueError:
                pass
        if self._rate_from is None:
            self._rate_from = (step, now)
        self.step = step
        if self.mode == "quiet":
            return
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.n = step
            self._bar.set_postfix(self._postfix(), refresh=True)
            return
        evals = {k: v for k, v in progress.values.items() if k.startswith("eval")}
        if self._shown_step is None or now - self._last_shown >= self.every_s or evals:
            self._show_plain(evals)

    def _rate(self) -> float | None:
        if self._rate_from is None or self.step is None:
            return None
        step0, t0 = self._rate_from
        elapsed = time.monotonic() - t0
        return (self.step - step0) / elapsed if self.step > step0 and elapsed > 0 else None

    def _loss(self) -> tuple[str, str]:
        """The loss to show: ``loss``, else the first loss-like key the function logs that is not an evaluation's
        (``train_loss`` of transformers' example scripts), else the first evaluation's; ``loss=-`` before any."""
        if "loss" in self.metrics:
            return "loss", self.metrics["loss"]
        losses = [k for k in self.metrics if "loss" in k.lower()]
        ranked = sorted(losses, key=lambda k: k.lower().startswith(("eval", "val", "test")))
        return (ranked[0], self.metrics[ranked[0]]) if ranked else ("loss", "-")

    def _postfix(self) -> dict:
        post = dict([self._loss()])
        if "samples_per_s" in self.metrics:
            post["samples/s"] = self.metrics["samples_per_s"]
        post.update({key: self.metrics[key] for key in PACE if key in self.metrics})
        post["attempt"], post["restarts"] = self.attempt, self.restarts
        if "world_size" in self.metrics:
            post["world"] = self.metrics["world_size"]
        return post

    def _show_plain(self, evals: dict | None = None) -> None:
        self._shown_step, self._last_shown = self.step, time.monotonic()
        of = f"/{self.total} ({100 * self.step / self.total:.0f}%)" if self.total else ""
        post = self._postfix()
        values = {k: v for k, v in post.items() if k not in ("attempt", "restarts", "world")}
        shown = " ".join(f"{k}={v}" for k, v in {**values, **(evals or {})}.items())
        elapsed = time.monotonic() - self.started
        rate = self._rate()
        remaining = _clock((self.total - self.step) / rate) if rate and self.total else "?"
        world = f" world {post['world']}" if "world" in post else ""
        print(f"raylaunch: step {self.step}{of} {shown} | elapsed {_clock(elapsed)} remaining {remaining} "
              f"| attempt {self.attempt} restarts {self.restarts}{world}", file=self.out, flush=True)

