"""The machines a run uses: the inventory, SSH, shipping, setup, discovery, checks, bench.

* :mod:`~meshtrain.hosts.inventory`: the YAML inventory of hosts (rank 0 first).
* :mod:`~meshtrain.hosts.ssh`: paramiko connections, host keys, remote processes, quoting.
* :mod:`~meshtrain.hosts.host_output`, :mod:`~meshtrain.hosts.safe_copy`: what a (possibly
  hostile) host prints and sends back, confined and bounded.
* :mod:`~meshtrain.hosts.shipping`, :mod:`~meshtrain.hosts.transfer`: files to and from hosts.
* :mod:`~meshtrain.hosts.provisioning`: ``meshtrain hosts setup``.
* :mod:`~meshtrain.hosts.discovery`: ``meshtrain hosts discover`` (mDNS).
* :mod:`~meshtrain.hosts.checks`: ``meshtrain hosts check``.
* :mod:`~meshtrain.hosts.bench`: ``meshtrain hosts bench`` (the measured cluster file).
"""

from meshtrain.hosts.inventory import Host, Inventory, InventoryError, Rendezvous, load_inventory

__all__ = ["Host", "Inventory", "InventoryError", "Rendezvous", "load_inventory"]
