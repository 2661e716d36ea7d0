"""Where the tests find the repository and their data, from whichever folder a test is in."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
