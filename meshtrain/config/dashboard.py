"""The options of ``meshtrain dashboard``, defined once like the training settings (see
:mod:`meshtrain.config.plan`): the commands' options are generated from the fields, and
:func:`~meshtrain.config.settings.from_flags` applies their limits."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config.settings import OPTIONS, Flag, setting

DASHBOARD = "dashboard"
#: The address the dashboard listens on unless told otherwise: this machine only.
LOCALHOST = "127.0.0.1"


def _flag(*names: str) -> Flag:
    return Flag(names, OPTIONS, (DASHBOARD,))


@dataclass
class DashboardSettings:
    """``meshtrain dashboard``: where the web server listens."""

    host: str = setting(LOCALHOST, "Address to listen on. Anything but 127.0.0.1 exposes the page to the "
                                   "network (a warning says so).", flag=_flag("--host"))
    port: int = setting(0, "Port to listen on (0: a free one).", minimum=0, maximum=65535,
                        flag=_flag("--port"))
