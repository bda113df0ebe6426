"""`python -m burstengine ...` (and `torchrun ... -m burstengine ...`): the `burstengine` command."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
