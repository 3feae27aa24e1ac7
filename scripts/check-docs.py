#!/usr/bin/env python3
"""Checks that what README.md and docs/**/*.md name exists, so that the docs cannot go stale
silently:

- repository paths (`ops/attention.cpp`, `kernels/cpu/flash_attention` as a stem,
  `ops/attention_heads.{hpp,cpp}`, `fuzz/fuzz_*.cpp`, `attn/ops/attention.hpp` as an include
  path under include/, `file:line` suffixes dropped), in code spans, code blocks and prose;
- links between pages and their #anchors (GitHub's heading slugs);
- test names: GoogleTest `Suite.Case` (or `Suite.*`) among the tests/ sources, and `test_<name>`
  as a test binary (tests/test_<name>.cpp), a Python test file (python/tests/test_<name>.py) or
  a pytest function (`def test_<name>`), also as `file.py::test_<name>`;
- `attn ...` command lines (in code spans and shell code blocks): every subcommand exists and
  every flag is listed by `attn <subcommand> --help` of the built binary (--attn).

Usage: /usr/bin/python3 scripts/check-docs.py [--attn build/default/attn]
Without --attn the command lines are not checked (it says so). Python standard library only.
Prints one line per problem (`file:line: what`) and exits 1 if there is any, else 0.
"""
import argparse
import glob
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Top-level folders of the repository: a word starting with one of these and a slash is a path.
TOP = ("bench", "cmake", "core", "docs", "examples", "fuzz", "include", "kernels", "model", "nn",
       "ops", "python", "scripts", "tests", "tools", "viz", ".ci")
PATH_RE = re.compile(r"(?<![\w/.@~-])((?:%s)/[\w./{},*+-]*)" % "|".join(re.escape(t) for t in TOP))
# Public include paths, as the docs write them after #include: attn/<layer>/<name>.hpp.
INCLUDE_RE = re.compile(r"(?<![\w/.-])(attn/[\w/.-]+\.hpp)")
# Outside the repository on purpose: the project's reference texts sit beside it.
EXTERNAL = ("reference/", "seeds/")

GTEST_RE = re.compile(r"^([A-Z][A-Za-z0-9]+)\.([A-Z][A-Za-z0-9_]*|\*)$")
TEST_WORD_RE = re.compile(r"(?<![\w/.-])(test_[a-z0-9_]+)(?:\.(cpp|py))?(?:::(test_\w+))?\b")
SHELL_FENCES = ("", "sh", "bash", "console", "shell", "text")


COUNTS = {"paths": 0, "links": 0, "tests": 0, "commands": 0}


def problem(problems, where, what):
    problems.append(f"{where}: {what}")


def rel(path):
    return os.path.relpath(path, ROOT)


# --- paths -------------------------------------------------------------------------------------

def expand_braces(word):
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    out = []
    for alt in m.group(1).split(","):
        out += expand_braces(word[:m.start()] + alt + word[m.end():])
    return out


def path_exists(word):
    """True if the repository has `word`: a file or folder, a glob, or a stem (no extension)."""
    for w in expand_braces(word):
        full = os.path.join(ROOT, w)
        if any(c in w for c in "*?"):
            if not glob.glob(full):
                return False
            continue
        if os.path.exists(full):
            continue
        base = os.path.basename(w.rstrip("/"))
        if "." not in base and (glob.glob(full + ".*") or glob.glob(full + "-inl.h")):
            continue
        return False
    return True


def clean_path(word):
    word = re.sub(r":[0-9][0-9,-]*$", "", word)  # file:line, file:12-30
    return word.rstrip(".,;:)")


# --- tests -------------------------------------------------------------------------------------

def gtest_names():
    names = set()
    pat = re.compile(r"\b(?:TEST|TEST_F|TEST_P|TYPED_TEST|TYPED_TEST_P)\(\s*(\w+)\s*,\s*(\w+)\s*\)")
    for f in glob.glob(os.path.join(ROOT, "tests", "**", "*.cpp"), recursive=True):
        with open(f, encoding="utf-8") as fh:
            for suite, case in pat.findall(fh.read()):
                names.add((suite, case))
    return names


def python_test_functions():
    names = {}
    for f in glob.glob(os.path.join(ROOT, "python", "tests", "**", "*.py"), recursive=True):
        with open(f, encoding="utf-8") as fh:
            for name in re.findall(r"^\s*def (test_\w+)\(", fh.read(), re.M):
                names.setdefault(name, set()).add(os.path.basename(f))
    return names


def test_files():
    stems = {}
    for pattern in ("tests/**/test_*.cpp", "python/tests/**/test_*.py", "tests/**/test_*.py"):
        for f in glob.glob(os.path.join(ROOT, pattern), recursive=True):
            stems.setdefault(os.path.splitext(os.path.basename(f))[0], []).append(rel(f))
    return stems


# --- the attn command line ---------------------------------------------------------------------

class Cli:
    """`attn <path> --help`, parsed once per subcommand path: its flags, subcommands, positionals."""

    def __init__(self, binary):
        self.binary = binary
        self.cache = {}

    def level(self, path):
        if path not in self.cache:
            run = subprocess.run([self.binary, *path, "--help"], capture_output=True, text=True)
            flags, subs, positionals, section = set(), set(), False, None
            for line in run.stdout.splitlines():
                if re.match(r"^\S.*:$", line):
                    section = line[:-1].strip().lower()
                    continue
                m = re.match(r"^  (\S+)", line)
                if not m:
                    continue
                if section == "options":
                    flags.update(n for n in m.group(1).split(",") if n.startswith("-"))
                elif section == "subcommands":
                    subs.add(m.group(1))
                elif section == "positionals":
                    positionals = True
            self.cache[path] = (run.returncode == 0, flags, subs, positionals)
        return self.cache[path]

    def check(self, words, where, problems):
        """words: what follows `attn` on a command line, up to a shell separator."""
        path = ()
        ok, flags, subs, positionals = self.level(path)
        expect_sub = True  # the word right after `attn` (or a command with subcommands)
        for w in words:
            if w.startswith("<") or w in ("...", "..") or "$" in w or w in PLACEHOLDERS:
                return  # a placeholder: `attn <subcommand> --help`
            if w.startswith("-") and not re.match(r"^-[0-9.]", w) and w != "-":
                name = w.split("=", 1)[0]
                if name not in flags:
                    problem(problems, where, f"`attn {' '.join(path)}` has no flag {name} "
                            f"(attn {' '.join(path + ('--help',))})")
                expect_sub = False
                continue
            if w in subs:
                path += (w,)
                ok, flags, subs, positionals = self.level(path)
                expect_sub = bool(subs) and not positionals
                continue
            if expect_sub and subs and not positionals:
                problem(problems, where, f"`attn {' '.join(path + (w,))}`: no subcommand {w!r} "
                        f"(`{' '.join(('attn',) + path)}` has {', '.join(sorted(subs))})")
                return
            expect_sub = False


SEPARATORS = {"|", "||", "&&", ";", ">", ">>", "2>", "2>&1", "<", "&", ":"}
# Conventional names of something that does not exist: `attn foo` shows the error.
PLACEHOLDERS = {"foo", "bar"}


def attn_commands(text):
    """Yields the words after each `attn` that starts a command in a shell line or code span."""
    for m in re.finditer(r"(?:^|(?<=[\s/$(]))attn(?=\s+[-a-z<])", text):
        before = text[:m.start()]
        # `import attn`, `pip install attn`, `cd attn`: attn is not a command there.
        if re.search(r"(?:import|install|from|cd|clone|-m|show)\s+$", before):
            continue
        if m.start() > 0 and text[m.start() - 1] == "/" and not re.search(r"(?:^|\s)\S*/$", before):
            continue
        rest = text[m.end():]
        try:
            words = shlex.split(rest, comments=True)
        except ValueError:
            words = rest.split()
        out = []
        for w in words:
            if w in SEPARATORS or w.startswith(">") or w.startswith("2>"):
                break
            out.append(w)
        yield out


# --- markdown ----------------------------------------------------------------------------------

def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    s = heading.strip().lower()
    s = re.sub(r"[`*_]", lambda c: "_" if c.group(0) == "_" else "", s)
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(md_path, cache={}):
    if md_path not in cache:
        seen, out = {}, set()
        in_fence = False
        with open(md_path, encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("```"):
                    in_fence = not in_fence
                    continue
                m = re.match(r"^#{1,6}\s+(.*)$", line)
                if m and not in_fence:
                    s = slug(m.group(1))
                    n = seen.get(s, 0)
                    seen[s] = n + 1
                    out.add(s if n == 0 else f"{s}-{n}")
        cache[md_path] = out
    return cache[md_path]


def markdown_files():
    files = [os.path.join(ROOT, "README.md")]
    files += sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return files


def check_file(md, cli, gtests, pyfuncs, tfiles, problems):
    name = rel(md)
    fence = None  # the language of the open code block, or None
    pending = ""  # a shell line continued with a backslash
    with open(md, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    for i, line in enumerate(lines, 1):
        where = f"{name}:{i}"
        m = re.match(r"^\s*```\s*(\S*)", line)
        if m:
            fence = None if fence is not None else m.group(1).lower()
            pending = ""
            continue
        # Paths anywhere (prose, spans, blocks), except inside URLs.
        text = re.sub(r"https?://\S+", "", line)
        for word in PATH_RE.findall(text):
            end = text.find(word) + len(word)
            if end < len(text) and text[end] == "<":
                continue  # a pattern such as tests/test_<layer>_<subject>.cpp
            word = clean_path(word)
            if word.endswith("_") or word.endswith("-"):
                continue
            COUNTS["paths"] += 1
            if not path_exists(word):
                problem(problems, where, f"no such path in the repository: {word}")
        for word in INCLUDE_RE.findall(text):
            COUNTS["paths"] += 1
            if not os.path.exists(os.path.join(ROOT, "include", word)):
                problem(problems, where, f"no such public header: include/{word}")
        # Links between pages.
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"^[a-z]+:", target):
                continue
            COUNTS["links"] += 1
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(md), file_part)) if file_part else md
            if rel(dest).startswith(EXTERNAL):
                continue
            if not os.path.exists(dest):
                problem(problems, where, f"link to a missing file: {target}")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                problem(problems, where, f"link to a missing heading: {target}")
        # Code: spans everywhere, whole lines in shell blocks.
        if fence is not None:
            codes = [line] if fence in SHELL_FENCES else []
        else:
            codes = re.findall(r"`([^`]+)`", line)
        for code in codes:
            m = GTEST_RE.match(code.strip())
            if m:
                COUNTS["tests"] += 1
                suite, case = m.groups()
                if not any(s == suite and (case == "*" or c == case) for s, c in gtests):
                    problem(problems, where, f"no GoogleTest {suite}.{case} in tests/")
        spans = [(code, line[:line.find("`" + code + "`")]) for code in codes] if fence is None else []
        for code, before in spans:
            if before.endswith("'s "):
                continue  # another project's test: llm.c's `test_gpt2`
            for stem, ext, func in TEST_WORD_RE.findall(code):
                COUNTS["tests"] += 1
                if func:
                    if stem + ".py" not in pyfuncs.get(func, ()):
                        problem(problems, where, f"no pytest {stem}.py::{func}")
                elif stem in tfiles:
                    if ext and not any(f.endswith(f"{stem}.{ext}") for f in tfiles[stem]):
                        problem(problems, where, f"no test file {stem}.{ext}")
                elif stem not in pyfuncs:
                    problem(problems, where, f"no test named {stem} (a tests/ or python/tests/ "
                            "file or a pytest function)")
        # Prose test file names without a folder (tests/... is checked as a path above).
        for stem, ext, _ in TEST_WORD_RE.findall(re.sub(r"`[^`]*`", "", text)) if fence is None else []:
            if ext and stem not in tfiles:
                problem(problems, where, f"no test file {stem}.{ext}")
        if cli is None:
            continue
        if fence is not None:
            if fence not in SHELL_FENCES:
                continue
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            shell = [pending + line]
            pending = ""
        else:
            shell = codes
        for code in shell:
            code = code.replace("\\|", "|")
            for words in attn_commands(code):
                COUNTS["commands"] += 1
                cli.check(words, where, problems)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attn", help="the built attn binary; its --help output checks the commands")
    args = ap.parse_args()
    cli = None
    if args.attn:
        if not os.access(args.attn, os.X_OK):
            sys.exit(f"check-docs: --attn {args.attn} is not an executable")
        cli = Cli(os.path.abspath(args.attn))
    gtests, pyfuncs, tfiles = gtest_names(), python_test_functions(), test_files()
    problems = []
    files = markdown_files()
    for md in files:
        check_file(md, cli, gtests, pyfuncs, tfiles, problems)
    for p in problems:
        print(p)
    sys.stdout.flush()
    checked = ", ".join(f"{n} {what}" for what, n in COUNTS.items())
    if cli is None:
        checked += " (attn commands not checked: no --attn)"
    print(f"check-docs: {len(files)} pages; checked {checked}; {len(problems)} problem(s)",
          file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
