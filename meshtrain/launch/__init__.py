"""Running ranks on real machines: inventory, SSH, preflight checks and the launcher.

* :mod:`~meshtrain.launch.inventory`: the YAML inventory of hosts (rank 0 first).
* :mod:`~meshtrain.launch.ssh`: paramiko connections, host keys, remote processes.
* :mod:`~meshtrain.launch.checks`: ``meshtrain hosts check``.
* :mod:`~meshtrain.launch.launcher`: ``meshtrain launch``: start, stream, tear down.
* :mod:`~meshtrain.launch.output`: each rank's output, prefixed with host and rank.
"""

from meshtrain.launch.inventory import Host, Inventory, InventoryError, Rendezvous, load_inventory

__all__ = ["Host", "Inventory", "InventoryError", "Rendezvous", "load_inventory"]
