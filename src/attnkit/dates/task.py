"""Date normalisation as translation: many surface forms of a date -> ISO 8601 "YYYY-MM-DD".

    "the 3rd of march 2021", "3/3/21", "March 3, 2021", "03.03.2021"  ->  "2021-03-03"

Everything is generated deterministically from a seed: no download. Years run 1950-2049, so a
two-digit year is unambiguous (50-99 -> 19xx, 00-49 -> 20xx). Slashed dates are month first (US).

`CharTokenizer` maps characters to ids with 0 = padding, 1 = start, 2 = end, 3 = unknown; one
vocabulary serves inputs and outputs, so the embeddings can be shared.
"""

import datetime
import re

import numpy as np

MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september",
          "october", "november", "december")
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
FIRST_DAY, LAST_DAY = datetime.date(1950, 1, 1), datetime.date(2049, 12, 31)


def ordinal(n):
    """1 -> "1st", 2 -> "2nd", 11 -> "11th", 23 -> "23rd"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# Each format turns a date into one surface form; the order is part of the generated data.
FORMATS = (
    lambda d: f"the {ordinal(d.day)} of {MONTHS[d.month - 1]} {d.year}",
    lambda d: f"{d.month}/{d.day}/{d.year % 100:02d}",
    lambda d: f"{MONTHS[d.month - 1].capitalize()} {d.day}, {d.year}",
    lambda d: f"{d.day:02d}.{d.month:02d}.{d.year}",
    lambda d: f"{d.day} {MONTHS[d.month - 1][:3]} {d.year}",
    lambda d: f"{WEEKDAYS[d.weekday()]}, {MONTHS[d.month - 1]} {ordinal(d.day)}, {d.year}",
    lambda d: f"{d.day:02d}-{MONTHS[d.month - 1][:3].upper()}-{d.year % 100:02d}",
    lambda d: f"{d.year}/{d.month}/{d.day}",
    lambda d: f"{MONTHS[d.month - 1][:3]}. {ordinal(d.day)} '{d.year % 100:02d}",
)


def iso(date):
    return date.isoformat()


def random_dates(n, rng):
    """`n` dates drawn uniformly from 1950-01-01 .. 2049-12-31."""
    span = (LAST_DAY - FIRST_DAY).days + 1
    return [FIRST_DAY + datetime.timedelta(days=int(x)) for x in rng.integers(0, span, size=n)]


def generate(n, seed=0):
    """`n` (source, target) string pairs, a random date in a random format each; deterministic."""
    rng = np.random.default_rng(seed)
    dates = random_dates(n, rng)
    formats = rng.integers(0, len(FORMATS), size=n)
    return [(FORMATS[f](d), iso(d)) for d, f in zip(dates, formats)]


def train_validation_split(n_train, n_validation, seed=0):
    """Two disjoint lists of (source, target) pairs: no source string of validation is in training."""
    pairs = generate(n_train + n_validation + n_validation // 2 + 16, seed)
    train, validation, seen = [], [], set()
    for source, target in pairs:
        if len(train) < n_train:
            train.append((source, target))
            seen.add(source)
        elif source not in seen and len(validation) < n_validation:
            validation.append((source, target))
    return train, validation


class CharTokenizer:
    """Characters <-> ids. 0 = padding, 1 = start, 2 = end, 3 = unknown, then the alphabet.

    Args:
        alphabet: the characters, in id order; default every character the date formats use.
    """

    PAD, START, END, UNKNOWN = 0, 1, 2, 3
    SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")

    def __init__(self, alphabet=None):
        if alphabet is None:
            alphabet = sorted(set("".join(s + t for s, t in generate(4000, seed=12345))) | set("0123456789-"))
        self.alphabet = "".join(alphabet)
        self.ids = {c: i + len(self.SPECIALS) for i, c in enumerate(self.alphabet)}

    @property
    def vocab_size(self):
        return len(self.SPECIALS) + len(self.alphabet)

    def encode(self, text, length, *, start=False, end=False):
        """`text` as ids, padded with 0 to `length` (int32 array (length,)); too long -> ValueError."""
        ids = ([self.START] if start else []) + [self.ids.get(c, self.UNKNOWN) for c in text]
        ids += [self.END] if end else []
        if len(ids) > length:
            raise ValueError(f"`text` is {len(ids)} tokens long, more than length={length}. Received: text={text!r}")
        return np.array(ids + [self.PAD] * (length - len(ids)), dtype=np.int32)

    def encode_batch(self, texts, length, *, start=False, end=False):
        """(N, length) int32 ids."""
        return np.stack([self.encode(t, length, start=start, end=end) for t in texts])

    def decode(self, ids):
        """Ids -> text, stopping at the end token and skipping padding and the start token."""
        chars = []
        for i in np.asarray(ids).tolist():
            if i == self.END:
                break
            if i >= len(self.SPECIALS):
                chars.append(self.alphabet[i - len(self.SPECIALS)])
            elif i == self.UNKNOWN:
                chars.append("?")
        return "".join(chars)

    def display_tokens(self, ids):
        """One label per generated id, up to and including the end token, for attention plots."""
        labels = []
        for i in np.asarray(ids).tolist():
            labels.append(self.SPECIALS[i] if i < len(self.SPECIALS) else self.alphabet[i - len(self.SPECIALS)])
            if i == self.END:
                break
        return labels

    def get_config(self):
        return {"alphabet": self.alphabet}


def is_iso_date(text):
    """Whether `text` is exactly "YYYY-MM-DD" and a real calendar day ("2021-02-29" is not)."""
    if not isinstance(text, str) or len(text) != 10 or text[4] != "-" or text[7] != "-":
        return False
    digits = text[:4] + text[5:7] + text[8:]
    if not (digits.isascii() and digits.isdigit()):
        return False
    try:
        datetime.date(int(text[:4]), int(text[5:7]), int(text[8:]))
    except ValueError:
        return False
    return True


def is_task_date(text):
    """Whether `text` is an ISO date (`is_iso_date`) within FIRST_DAY..LAST_DAY: the only answers a
    translator of this task can give right (a model's "1021-03-03" is a calendar day, and wrong)."""
    return is_iso_date(text) and FIRST_DAY <= datetime.date.fromisoformat(text) <= LAST_DAY


_NUMERIC = re.compile(r"^\s*(\d{1,4})([/.-])(\d{1,2})\2(\d{1,4})\s*$")
_MONTH = re.compile(r"\b(" + "|".join(m[:3] for m in MONTHS) + r")[a-z]*\.?", re.IGNORECASE)
_DAY_MON_YY = re.compile(r"^\s*(\d{1,2})-(" + "|".join(m[:3] for m in MONTHS) + r")-(\d{2})\s*$", re.IGNORECASE)
_DAY = re.compile(r"\b(\d{1,2})(?:st|nd|rd|th)?\b(?!\s*[/.-]\d)", re.IGNORECASE)
_YEAR = re.compile(r"(?:\b(\d{4})\b|'(\d{2})\b)")


def _full_year(text):
    """"21" -> 2021, "76" -> 1976 (the module's rule), "1976" -> 1976."""
    year = int(text)
    return year if len(text) > 2 else (1900 + year if year >= 50 else 2000 + year)


def no_such_date(text):
    """Why `text`, written as a date in one of the shapes this task knows, names no calendar day
    within FIRST_DAY..LAST_DAY, or None when it does (or when its shape is not one the task knows).

    Numeric shapes: Y/M/D and Y-M-D (a four-digit first field), M/D/YY (US), D.M.Y; DD-MON-YY. Worded shapes:
    a month name (or its first three letters), a day (ordinals allowed) and a four-digit year or 'YY.
    A translator asked for "2021-13-45" would still answer some date; this names the problem instead.

    >>> no_such_date("2021-13-45")
    'month 13 does not exist'
    >>> no_such_date("February 30, 2021")
    'february 2021 has no day 30'
    """
    numeric = _NUMERIC.match(text)
    if numeric:
        first, sep, middle, last = numeric.groups()
        if len(first) == 4:  # Y/M/D, Y-M-D
            year, month, day = first, middle, last
        elif sep == "/":  # M/D/YY, US order (module docstring)
            month, day, year = first, middle, last
        elif sep == ".":  # D.M.Y
            day, month, year = first, middle, last
        else:
            return None
        if len(year) not in (2, 4):
            return None
        return _calendar_problem(_full_year(year), int(month), int(day))
    worded = _DAY_MON_YY.match(text)  # 03-MAR-21
    if worded:
        day, name, year = worded.groups()
        return _calendar_problem(_full_year(year), _month_number(name), int(day))
    month = _MONTH.search(text)
    if not month:
        return None
    rest = text[:month.start()] + " " + text[month.end():]
    years = [y or z for y, z in _YEAR.findall(rest)]
    rest = _YEAR.sub(" ", rest)
    days = _DAY.findall(rest)
    if len(years) != 1 or len(days) != 1:
        return None
    return _calendar_problem(_full_year(years[0]), _month_number(month.group(1)), int(days[0]))


def _month_number(name):
    """"Mar", "march" -> 3."""
    return [m[:3] for m in MONTHS].index(name[:3].lower()) + 1


def _calendar_problem(year, month, day):
    if not 1 <= month <= 12:
        return f"month {month} does not exist"
    try:
        date = datetime.date(year, month, day)
    except ValueError:
        return f"{MONTHS[month - 1]} {year} has no day {day}"
    if not FIRST_DAY <= date <= LAST_DAY:
        return f"{iso(date)} is outside the years the model knows ({FIRST_DAY.year}-{LAST_DAY.year})"
    return None
