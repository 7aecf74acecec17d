"""``python -m pflkit.cli``: as the console script (:mod:`pflkit.__main__`), SIGTERM included."""

from pflkit.cli import main
from pflkit.errors import sigterm_as_interrupt

sigterm_as_interrupt()
main()
