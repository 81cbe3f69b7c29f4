"""The options of ``meshtrain compare`` and ``meshtrain plot`` that are not training settings,
defined once like the training settings: each field carries its help, limits and
:class:`~meshtrain.config.settings.Flag`, the commands' options are generated from them and
:func:`~meshtrain.config.settings.from_flags` applies the limits. (``compare`` takes the
training settings as well: :class:`~meshtrain.config.spec.RunSpec`'s flags that name it.)
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config.settings import OPTIONS, WHAT, Flag, setting

COMPARE, PLOT = "compare", "plot"


@dataclass
class CompareSettings:
    """``meshtrain compare``: which strategies, and the loss their steps are counted to."""

    strategies: str = setting("ddp,diloco,sparta", "Comma-separated strategies to compare.",
                              flag=Flag(("--strategies", "-s"), WHAT, (COMPARE,)))
    target_loss: float | None = setting(
        None, "Validation loss to count steps and time to (default: 1.05 x DDP's final val loss).",
        above=0, flag=Flag(("--target-loss",), WHAT, (COMPARE,)))


@dataclass
class PlotSettings:
    """``meshtrain plot``: where the figures go, and a loss to mark."""

    out: str = setting("plots", "Folder for the PNG and SVG files.", flag=Flag(("--out",), OPTIONS, (PLOT,)))
    target_loss: float | None = setting(None, "Draw this loss as a dotted line.", above=0,
                                        flag=Flag(("--target-loss",), OPTIONS, (PLOT,)))
