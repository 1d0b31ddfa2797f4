"""Copy a command's output to a file as it comes, each line stamped with the seconds since the
first byte, and end with the longest gap between two lines: how often a long run said something.

    COMMAND 2>&1 | python3 benchmarks/stamp.py FILE

Progress bars redraw a line with a carriage return; each redraw counts as a line here. The output
also goes on to stdout, unstamped, as it comes.
"""

from __future__ import annotations

import codecs
import re
import sys
import time


def main() -> int:
    path = sys.argv[1]
    t0 = last = time.monotonic()
    longest, at = 0.0, 0.0
    pending = ""
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
    with open(path, "w", buffering=1) as f:
        while True:
            chunk = sys.stdin.buffer.read1(4096)
            if not chunk:
                break
            text = decode(chunk)
            sys.stdout.write(text)
            sys.stdout.flush()
            pending += text
            *lines, pending = re.split(r"\r\n|\r|\n", pending)
            for line in lines:
                now = time.monotonic()
                if now - last > longest:
                    longest, at = now - last, now - t0
                last = now
                f.write(f"{now - t0:8.1f}  {line}\n")
        if pending:
            f.write(f"{time.monotonic() - t0:8.1f}  {pending}\n")
        total = time.monotonic() - t0
        f.write(f"# {total:.1f} s in all; the longest gap between two lines: {longest:.1f} s, "
                f"ending at {at:.1f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
