#!/usr/bin/env python3
"""The held-out dates of `attn train --task dates`, as text, for bench/run_peers_translate.sh.

    peers_dates.py OUT.tsv      one "source<TAB>target" line per held-out date and phrasing

Written here from the task's definition (docs/seq2seq-data.md, model/seq2seq_tasks.cpp): dates
1900-01-01 .. 2099-12-31 in two phrasings ("the third of march two thousand and five", "march
the third two thousand and five") -> "2005 - 03 - 03"; a date is held out iff the FNV-1a +
splitmix64 hash of its ISO tokens falls in bucket 0 of 10. The count is checked against the one
the C++ test pins (7,165 held-out dates), so a drift from the C++ generator stops the benchmark
instead of comparing engines on training data.
"""
import datetime
import sys

MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august", "september",
          "october", "november", "december"]
UNITS = ["", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
         "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
ORDINAL_UNITS = ["", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
                 "ninth", "tenth", "eleventh", "twelfth", "thirteenth", "fourteenth",
                 "fifteenth", "sixteenth", "seventeenth", "eighteenth", "nineteenth"]
HELD_OUT_DATES = 7165
M64 = (1 << 64) - 1


def cardinal(n):
    if n < 20:
        return [UNITS[n]]
    return [TENS[n // 10]] + ([UNITS[n % 10]] if n % 10 else [])


def ordinal(n):
    if n < 20:
        return [ORDINAL_UNITS[n]]
    if n % 10 == 0:
        return ["twentieth" if n == 20 else "thirtieth"]
    return [TENS[n // 10], ORDINAL_UNITS[n % 10]]


def year_words(y):
    yy = y % 100
    if y < 2000:
        if yy == 0:
            return ["nineteen", "hundred"]
        return ["nineteen"] + (["oh"] if yy < 10 else []) + cardinal(yy)
    return ["two", "thousand"] + (["and"] + cardinal(yy) if yy else [])


def words_hash(tokens):
    h = 0xCBF29CE484222325
    for t in tokens:
        for c in t.encode():
            h = ((h ^ c) * 0x100000001B3) & M64
        h = (h * 0x100000001B3) & M64  # the 0 byte after each word
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & M64
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & M64
    h ^= h >> 31
    return h


def held_out_pairs():
    pairs, dates = [], 0
    day = datetime.date(1900, 1, 1)
    while day.year <= 2099:
        iso = [str(day.year), "-", f"{day.month:02}", "-", f"{day.day:02}"]
        if words_hash(iso) % 10 == 0:
            dates += 1
            month, y = MONTHS[day.month - 1], year_words(day.year)
            pairs.append((["the"] + ordinal(day.day) + ["of", month] + y, iso))
            pairs.append(([month, "the"] + ordinal(day.day) + y, iso))
        day += datetime.timedelta(days=1)
    if dates != HELD_OUT_DATES:
        sys.exit(f"peers_dates.py: {dates} held-out dates, the C++ task holds out "
                 f"{HELD_OUT_DATES}: this generator no longer matches model/seq2seq_tasks.cpp")
    return pairs


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: peers_dates.py OUT.tsv")
    with open(sys.argv[1], "w") as f:
        for src, tgt in held_out_pairs():
            f.write(" ".join(src) + "\t" + " ".join(tgt) + "\n")
