"""``python -m quantkit.cli`` runs the ``quantkit`` command."""
from . import main

main()
