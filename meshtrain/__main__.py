"""``python -m meshtrain`` is the ``meshtrain`` command (launched ranks use this form)."""

from meshtrain.cli.main import app

app()
