#!/usr/bin/env python3
"""Doxygen INPUT_FILTER for attn's headers (docs/Doxyfile runs it on every header).

The headers document declarations with plain // comments, in the style of STYLE.md; Doxygen
reads only ///, //! and /** */ comments. Rather than rewrite every header, this filter shows
Doxygen a converted copy (the files on disk are untouched):
  - the comment block that opens a file becomes the file's description (\\file);
  - a line holding only a // comment becomes ///, documenting the declaration below it;
  - a trailing // comment after code (a member, an enumerator, a parameter) becomes ///<;
  - section rulers ("// --- TSV ... ---") stay plain comments.
Line numbers are kept, so Doxygen's warnings point at the real lines.
"""
import re
import sys

RULER = re.compile(r"^\s*//\s*-{3}")
FULL = re.compile(r"^(\s*)//(?!/)(.*)$")
# Code, then a trailing comment. The code part must not hold a quote, so "//" inside a string
# literal is never taken for a comment.
TRAILING = re.compile(r'^(\s*[^\s/"\'][^"\']*?)\s*//(?![/!<])\s?(.*)$')


HTML_OK = {"b", "i", "em", "code", "tt", "br", "p", "pre", "sub", "sup"}


def escape(text):
    """Comment text as Doxygen should print it: <pad> is a token, not an HTML tag, and "\\r"
    is the two characters of a C escape, not a command."""
    text = re.sub(r"\\([A-Za-z0-9])", r"\\\\\1", text)
    return re.sub(r"<(/?)([A-Za-z_][\w-]*)>",
                  lambda m: m.group(0) if m.group(2).lower() in HTML_OK
                  else "\\<" + m.group(1) + m.group(2) + "\\>", text)


def convert(lines):
    out = []
    in_header = True  # still inside the comment block at the top of the file
    header_end = 0
    for i, line in enumerate(lines):
        if in_header and FULL.match(line):
            header_end = i
            continue
        in_header = False
    for i, line in enumerate(lines):
        m = FULL.match(line)
        if i <= header_end and m and lines[0].lstrip().startswith("//"):
            text = "///" + escape(m.group(2))
            if i == header_end:
                text += " \\file"  # \file at a line's end: this file, no name argument
            out.append(text)
        elif m and not RULER.match(line):
            out.append(m.group(1) + "///" + escape(m.group(2)))
        elif not m:
            t = TRAILING.match(line)
            # "}  // namespace attn" and "#endif  // X" are not documentation.
            if t and not re.match(r"^\s*(\}|#)", t.group(1)):
                out.append(t.group(1) + "  ///< " + escape(t.group(2)))
            else:
                out.append(line)
        else:
            out.append(line)
    return out


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        lines = f.read().split("\n")
    sys.stdout.write("\n".join(convert(lines)))


if __name__ == "__main__":
    main()
