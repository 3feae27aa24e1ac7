#!/usr/bin/env python3
"""Replaces one generated block of a Markdown document, atomically.

    write_block.py NAME BODY_FILE DOC

The block is the text between "<!-- NAME:begin -->" and "<!-- NAME:end -->" in DOC; it becomes
the contents of BODY_FILE. A DOC without the block gets it appended (a missing DOC is created).
The new document goes to a temporary file in DOC's directory and is renamed over DOC, so a
failed run never leaves half a file. The scripts that write measured numbers into the docs
(bench/run_*.sh, scripts/experiment.sh) all go through here, so each owns only its block.
"""
import os
import sys
import tempfile


def write_block(name: str, body: str, doc: str) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.rstrip(chr(10))}\n{end}"
    text = open(doc).read() if os.path.exists(doc) else "# Performance\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(doc)))
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, doc)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: write_block.py NAME BODY_FILE DOC")
    write_block(sys.argv[1], open(sys.argv[2]).read(), sys.argv[3])
