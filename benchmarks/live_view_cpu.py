"""CPU the launcher's live view takes on the launching machine, per redraw rate.

The live view (``meshtrain launch`` on a terminal) redraws its panel and the log lines
under it several times a second. This drives a :class:`LiveOutput` for 2 ranks as a
launch does (a heartbeat every 0.25 s, a status frame from each rank every 0.5 s, 60 log
lines) on a forced 160x50 terminal writing to /dev/null, for ``--seconds`` at each rate,
alternating, ``--repeats`` times, and prints the medians of the process's CPU seconds.

    python benchmarks/live_view_cpu.py --rates 4,2,1 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from meshtrain.heartbeat import RankStatus
from meshtrain.launch.live import LiveOutput


class _Beats:
    last_beat: float | None = None


def drive(rate: float, seconds: float) -> float:
    """CPU seconds of this process over ``seconds`` of a 2-rank launch's live view."""
    with open(os.devnull, "w") as sink:
        out = LiveOutput(["box0", "box1"], stream=sink, force_terminal=True, refresh_per_second=rate)
        out.console.size = (160, 50)
        sources = [_Beats(), _Beats()]
        for rank, source in enumerate(sources):
            out.watch(rank, source)
        for i in range(60):
            out.line(i % 2, f"step {i}/100  loss 1.2345  a line of the rank's own output")
        started = time.process_time()
        with out:
            for tick in range(int(seconds / 0.25)):
                for rank, source in enumerate(sources):
                    source.last_beat = time.monotonic()
                    if tick % 2 == 0:
                        frame = RankStatus(tick, 1000, 1.0, 8.0, 1000 * tick, 10**8, tick, 99.0).encode()
                        out.line(rank, frame.decode().rstrip("\n"))
                time.sleep(0.25)
        return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="4,2", help="redraws per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    cpu: dict[float, list[float]] = {rate: [] for rate in rates}
    loads = []
    for _ in range(args.repeats):
        for rate in rates:
            loads.append(os.getloadavg()[0])
            cpu[rate].append(drive(rate, args.seconds))
    print(f"live view of 2 ranks, 160x50 terminal, {args.seconds:.0f} s, medians of {args.repeats}; "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'redraws/s':>10}{'CPU s':>8}{'share of a core':>17}")
    for rate, values in cpu.items():
        m = statistics.median(values)
        print(f"{rate:10g}{m:8.3f}{m / args.seconds:17.1%}")


if __name__ == "__main__":
    main()
