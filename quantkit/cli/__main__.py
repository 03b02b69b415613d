"""``python -m quantkit.cli`` runs the ``quantkit`` command."""
from . import run

run()
