"""``python -m pflkit`` and the ``pflkit`` console script: the command line. The modules load
inside :func:`main`, so that a Ctrl-C while they do (torch takes a second or more) ends like one
anywhere else: one line, exit 130; SIGTERM, until a command handles it itself, does the same
with exit 143."""

import sys

from pflkit.errors import sigterm_as_interrupt, terminated


def main() -> None:
    sigterm_as_interrupt()
    try:
        from pflkit.cli import main as cli_main
    except KeyboardInterrupt:
        how = "SIGTERM" if terminated() else "Ctrl-C"
        print(f"error: interrupted ({how}) while pflkit was starting: nothing ran", file=sys.stderr)
        sys.exit(143 if terminated() else 130)
    cli_main()


if __name__ == "__main__":
    main()
