"""`python -m sgl.launch_server [FLAGS]`: the same as `sgl serve [FLAGS]`."""

from __future__ import annotations

import sys

from sgl.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
