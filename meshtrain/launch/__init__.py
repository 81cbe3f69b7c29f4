"""Launching a run on real machines: start one rank per host, supervise, tear down, copy back.

* :mod:`~meshtrain.launch.launcher`: ``meshtrain launch``: start, stream, tear down.
* :mod:`~meshtrain.launch.output`: each rank's output, prefixed with host and rank.
* :mod:`~meshtrain.hosts.host_output`: reading what a (possibly hostile) host prints.
* :mod:`~meshtrain.hosts.safe_copy`: unpacking a host's run files inside the run directory.
* :mod:`~meshtrain.launch.live`: the live terminal view of every host.

The hosts themselves (inventory, SSH, shipping, setup, discovery, checks, bench) are
:mod:`meshtrain.hosts`.
"""
