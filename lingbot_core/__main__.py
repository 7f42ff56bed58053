"""``python -m lingbot_core generate ...``: the reference runner's main flags on this core."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
