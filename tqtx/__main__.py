"""``python -m tqtx ...`` is the ``tqtx`` command."""
from .cli import main

main()
