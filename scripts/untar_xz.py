#!/usr/bin/env python3
"""Unpacks a .tar.xz with Python's standard library alone, for machines without the xz program
(scripts/gpu_check.sh, on an archive from scripts/gpu_prebuild.sh).

    python3 scripts/untar_xz.py ARCHIVE DEST [MEMBER...]

With MEMBERs, only those; file modes (the programs' execute bits) are kept."""
import sys
import tarfile


def main(argv):
    if len(argv) < 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    archive, dest, members = argv[1], argv[2], argv[3:]
    with tarfile.open(archive, "r:xz") as t:
        # The archive is our own: extract as tar itself would (Python 3.12+ asks to be told).
        kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
        t.extractall(dest, members=[t.getmember(m) for m in members] or None, **kw)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
