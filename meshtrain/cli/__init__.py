"""The ``meshtrain`` command line (Typer). The library never imports it."""

from meshtrain.allocator import limit_malloc_arenas

# First thing the command does, before torch or any thread starts (glibc fixes its arena
# limit once a process has more than eight): see meshtrain.allocator.
limit_malloc_arenas()
