"""Rank 0's view of a run: a rich progress bar on a terminal, periodic lines elsewhere."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType

from rich import get_console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.progress import Task as RichTask
from rich.table import Column
from rich.text import Text

#: The bar's width where the terminal has room for it and every column.
BAR_WIDTH = 40
#: The narrowest bar worth showing: below it the optional columns go first.
MIN_BAR_WIDTH = 8


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


def human_seconds(seconds: float) -> str:
    """``seconds`` to three significant digits ("0.0705 s", "1.23 s", "123 s"): a total and
    its parts read as what they add up to (with two decimals, 0.035 + 0.035 = 0.07 showed
    as 0.04 + 0.04 = 0.07)."""
    return f"{seconds:.3g} s" if abs(seconds) < 1000 else f"{seconds:,.0f} s"


def clock(seconds: float) -> str:
    """``seconds`` as h:mm:ss."""
    whole = max(0, int(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def bar_layout(width: int, widths: dict[str, int], optional: tuple[str, ...]) -> tuple[int | None, list[str]]:
    """Which of a progress bar's columns to show on a terminal ``width`` wide, and the bar's
    width (None: what the other columns leave it). ``widths`` are the columns, in order, at
    their widest ("bar" among them, its width ignored). All of them beside a bar of
    :data:`BAR_WIDTH` where they fit; else the ``optional`` ones go, in that order, until
    the rest fit beside a bar of :data:`MIN_BAR_WIDTH`, so the bar stays one line."""
    shown = list(widths)

    def room(bar: int) -> bool:  # the columns, one space apart, and a bar this wide
        return sum(bar if name == "bar" else widths[name] for name in shown) + len(shown) - 1 <= width

    if room(BAR_WIDTH):
        return BAR_WIDTH, shown
    for name in optional:
        if room(MIN_BAR_WIDTH):
            break
        shown.remove(name)
    return None, shown


def _one_line() -> Column:
    return Column(no_wrap=True)


def _rich_bar(shown: list[str], bar_width: int | None, unit: str, began: float,
              own: dict[str, ProgressColumn]) -> RichProgress:
    """A rich progress bar of the columns ``shown`` (:func:`bar_layout`'s names): the bar,
    count, rate and clocks every bar here has, and the bar's ``own`` columns."""
    columns: dict[str, ProgressColumn] = {
        "bar": BarColumn(bar_width=bar_width),
        "count": MofNCompleteColumn(table_column=_one_line()),
        "rate": RateColumn(unit),
        "since": SinceColumn(began),
        "left": TextColumn("left", table_column=_one_line()),
        "remaining": TimeRemainingColumn(table_column=_one_line()),
        **own,
    }
    return RichProgress(*(columns[name] for name in shown), expand=bar_width is None)


class SinceColumn(ProgressColumn):
    """Time since ``began`` (the wall-clock time the work started, before the bar
    appeared): loading and checking count, so the clock never restarts at 0:00."""

    def __init__(self, began: float) -> None:
        super().__init__(table_column=_one_line())
        self.began = began

    def render(self, task: RichTask) -> Text:
        return Text(clock(time.time() - self.began), style="progress.elapsed")


class RateColumn(ProgressColumn):
    """Steps (or items) per second, as rich estimates the speed."""

    def __init__(self, unit: str) -> None:
        super().__init__(table_column=_one_line())
        self.unit = unit

    def render(self, task: RichTask) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{speed:.2f} {self.unit}/s", style="progress.data.speed")


class Progress:
    """Shows step, loss (mean of nodes), bytes sent per node, steps/s and the time left;
    does nothing when disabled.

    ``began`` is when the run's work began (``time.time()``; default: now): the clock
    shows the time since then, so minutes spent loading a model are not hidden.
    """

    def __init__(self, total: int, *, enabled: bool, title: str, began: float | None = None,
                 first_step: int = 0) -> None:
        self.total = total
        self.enabled = enabled
        self.title = title
        self.interactive = enabled and sys.stdout.isatty()
        self.began = time.time() if began is None else began
        self._bar: RichProgress | None = None
        self._next_line = 0
        self._first_step = first_step  # a resumed run's rate counts only its own steps
        self._loop_started = time.perf_counter()
        self.lines: list[str] = []  # the plain progress lines, kept for the run's log.txt

    def __enter__(self) -> Progress:
        if self.interactive:
            bar_width, shown = self.layout(get_console().width)
            self._bar = _rich_bar(shown, bar_width, "steps", self.began, {
                "title": TextColumn("[bold]{task.description}", table_column=_one_line()),
                "loss": TextColumn("loss {task.fields[loss]:.4f}", table_column=_one_line()),
                "sent": TextColumn("sent {task.fields[sent]}", table_column=_one_line())})
            self._bar.__enter__()
            self._task = self._bar.add_task(self.title, total=self.total, completed=self._first_step,
                                            loss=float("nan"), sent="0 B")
        self._loop_started = time.perf_counter()
        return self

    def layout(self, width: int) -> tuple[int | None, list[str]]:
        """The bar's width and its columns, by name, for a terminal ``width`` wide
        (:func:`bar_layout`): at 80 columns the bar had wrapped "steps/s" onto a line of its
        own, and cut "2000/2000" to "2000/…"; log.txt's plain lines keep every number."""
        digits = len(str(self.total))
        return bar_layout(width, {
            "title": len(self.title), "bar": 0, "count": 2 * digits + 1, "loss": len("loss 0.0000"),
            "sent": len("sent 999.99 kB"), "rate": len("9999.99 steps/s"), "since": len("0:00:00"),
            "left": len("left"), "remaining": len("0:00:00")}, optional=("since", "rate"))

    def rate(self, step: int) -> float | None:
        """Steps per second since the bar started (None before the first step)."""
        done, seconds = step - self._first_step, time.perf_counter() - self._loop_started
        return done / seconds if done > 0 and seconds > 0 else None

    def update(self, step: int, loss: float, bytes_sent: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=loss, sent=human_bytes(bytes_sent))
        if step >= self._next_line or step == self.total:
            # Plain lines (piped or streamed from remote ranks, and the log): about ten per run.
            line = f"step {step}/{self.total}  loss {loss:.4f}  sent {human_bytes(bytes_sent)}"
            rate = self.rate(step)
            if rate is not None:
                left = f"  left {clock((self.total - step) / rate)}" if step < self.total else ""
                line += f"  {rate:.2f} steps/s  {clock(time.time() - self.began)}{left}"
            self.lines.append(line)
            if self._bar is None:
                print(line, flush=True)
            self._next_line = step + max(1, self.total // 10)

    def note(self, line: str) -> None:
        """An event worth a line of its own (a node leaving), above the bar and in the log."""
        if not self.enabled:
            return
        self.lines.append(line)
        if self._bar is not None:
            self._bar.console.print(line, highlight=False, markup=False)
        else:
            print(line, flush=True)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.__exit__(exc_type, exc, tb)


class Status:
    """What happens before the first step, as a person waiting for it needs to see it.

    Each slow phase (loading a model, checking recordings, a test decode) announces itself
    with one line as it begins and says how long it took when it took over a second;
    a phase over many items (clips) shows a bar on a terminal, elsewhere a line every
    few seconds. Disabled, it prints nothing. Lines go to stdout, where the progress bar
    and its plain lines go.
    """

    #: Seconds between plain lines of a phase over items, when not on a terminal.
    LINE_EVERY = 5.0

    def __init__(self, enabled: bool = True, say: Callable[[str], None] | None = None) -> None:
        self.enabled = enabled
        # Where lines go: stdout, or a running Progress's note (above its bar, into the log).
        self.say = say

    def line(self, message: str) -> None:
        if not self.enabled:
            return
        if self.say is not None:
            self.say(message)
        else:
            print(message, flush=True)

    @contextlib.contextmanager
    def phase(self, message: str, *, after: float = 0.0) -> Iterator[None]:
        """``message ...`` as it begins; ``message: done in N s`` at the end if that was over
        a second. With ``after``, the first line waits that many seconds and is never
        printed when the phase is quicker (work that is usually instant, slow on a large
        model)."""
        started = time.perf_counter()
        if after <= 0:
            self.line(f"{message} ...")
            yield
        else:
            announced = threading.Event()  # the timer's line, then the end's, in that order
            lock = threading.Lock()

            def announce() -> None:
                with lock:
                    if not finished:
                        self.line(f"{message} ...")
                        announced.set()

            finished = False
            timer = threading.Timer(after, announce)
            timer.daemon = True
            timer.start()
            try:
                yield
            finally:
                with lock:
                    finished = True
                timer.cancel()
            if not announced.is_set():
                return
        took = time.perf_counter() - started
        if took >= 1.0:
            self.line(f"{message}: done in {took:.1f} s")

    @contextlib.contextmanager
    def items(self, message: str, total: int, unit: str) -> Iterator[Callable[[], None]]:
        """A phase over ``total`` items: yields ``advance()``, called after each item."""
        started = time.perf_counter()
        done = 0
        bar: RichProgress | None = None
        if self.enabled and sys.stdout.isatty():
            # On a narrow terminal the message goes on a line of its own above the bar.
            bar_width, shown = bar_layout(get_console().width, {
                "message": len(message), "bar": 0, "count": 2 * len(str(total)) + 1,
                "rate": len(f"9999.99 {unit}/s"), "since": len("0:00:00"), "left": len("left"),
                "remaining": len("0:00:00")}, optional=("message", "since", "rate"))
            if "message" not in shown:
                self.line(message)
            bar = _rich_bar(shown, bar_width, unit, time.time(),
                            {"message": TextColumn(message, table_column=_one_line())})
            bar.__enter__()
            task = bar.add_task(message, total=total)
        else:
            self.line(f"{message} ...")
        last_line = started

        def advance() -> None:
            nonlocal done, last_line
            done += 1
            if bar is not None:
                bar.update(task, completed=done)
                return
            now = time.perf_counter()
            if now - last_line >= self.LINE_EVERY and done < total:
                last_line = now
                rate = done / (now - started)
                self.line(f"  {done}/{total} {unit}, {rate:.1f} {unit}/s, "
                          f"left {clock((total - done) / rate)}")

        try:
            yield advance
        finally:
            if bar is not None:
                bar.__exit__(None, None, None)
        took = time.perf_counter() - started
        if took >= 1.0:
            self.line(f"{message}: {done} {unit} in {took:.1f} s")
