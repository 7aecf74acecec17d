"""``python -m pflkit``: the command line, for environments without the console script."""

from pflkit.cli import main

main()
