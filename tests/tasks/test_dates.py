"""The embedded date task: deterministic data, every format parses back to its date, a round-trip tokenizer."""

import datetime
import re

import numpy as np
import pytest

from attnkit.dates import task as dates

def month(name):
    """"march", "mar" or "MAR" -> 3."""
    return [m[:3] for m in dates.MONTHS].index(name.lower()[:3]) + 1


def year(yy):
    yy = int(yy)
    return yy if yy >= 100 else (1900 if yy >= 50 else 2000) + yy


def parse(source):
    """An independent reader of every surface format, to check the generated targets."""
    s = source.lower()
    patterns = (  # (regex, which groups are year, month, day)
        (r"the (\d+)(?:st|nd|rd|th) of ([a-z]+) (\d{4})", (3, 2, 1)),
        (r"(\d{1,2})/(\d{1,2})/(\d{2})", (3, 1, 2)),
        (r"([a-z]+) (\d+), (\d{4})", (3, 1, 2)),
        (r"(\d{2})\.(\d{2})\.(\d{4})", (3, 2, 1)),
        (r"(\d+) ([a-z]{3}) (\d{4})", (3, 2, 1)),
        (r"[a-z]+, ([a-z]+) (\d+)(?:st|nd|rd|th), (\d{4})", (3, 1, 2)),
        (r"(\d{2})-([a-z]{3})-(\d{2})", (3, 2, 1)),
        (r"(\d{4})/(\d+)/(\d+)", (1, 2, 3)),
        (r"([a-z]{3})\. (\d+)(?:st|nd|rd|th) '(\d{2})", (3, 1, 2)),
    )
    for pattern, (y, m, d) in patterns:
        if match := re.fullmatch(pattern, s):
            mm = match[m]
            return year(match[y]), int(mm) if mm.isdigit() else month(mm), int(match[d])
    raise AssertionError(f"unknown format: {source!r}")


def test_every_generated_target_is_the_iso_form_of_its_source():
    pairs = dates.generate(3000, seed=7)
    for source, target in pairs:
        assert target == datetime.date(*parse(source)).isoformat(), source
    formats_seen = {re.sub(r"\d", "9", s.lower())[:6] for s, _ in pairs}
    assert len(formats_seen) >= len(dates.FORMATS)


def test_weekday_format_names_the_right_day():
    for source, target in dates.generate(2000, seed=3):
        first = source.split(",")[0].lower()
        if first in dates.WEEKDAYS:
            assert dates.WEEKDAYS[datetime.date.fromisoformat(target).weekday()] == first


def test_generation_is_deterministic_and_depends_on_the_seed():
    assert dates.generate(50, seed=1) == dates.generate(50, seed=1)
    assert dates.generate(50, seed=1) != dates.generate(50, seed=2)


def test_split_is_disjoint_and_sized():
    train, validation = dates.train_validation_split(2000, 300, seed=0)
    assert len(train) == 2000 and len(validation) == 300
    assert not {s for s, _ in train} & {s for s, _ in validation}


@pytest.mark.parametrize("n, expected", [(1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (11, "11th"), (12, "12th"),
                                         (13, "13th"), (21, "21st"), (22, "22nd"), (23, "23rd"), (31, "31st")])
def test_ordinal(n, expected):
    assert dates.ordinal(n) == expected


def test_tokenizer_round_trip_and_specials():
    tok = dates.CharTokenizer()
    ids = tok.encode("the 3rd of march 2021", 30, start=True, end=True)
    assert ids.dtype == np.int32 and ids.shape == (30,)
    assert ids[0] == tok.START and tok.END in ids and ids[-1] == tok.PAD
    assert tok.decode(ids) == "the 3rd of march 2021"
    assert "~" not in tok.alphabet
    assert tok.encode("1~", 3)[1] == tok.UNKNOWN and tok.decode(tok.encode("1~", 3)) == "1?"
    with pytest.raises(ValueError, match="more than length=3"):
        tok.encode("2021-03-03", 3)
    assert dates.CharTokenizer(tok.alphabet).vocab_size == tok.vocab_size


def test_display_tokens_stop_at_the_end_token():
    tok = dates.CharTokenizer()
    ids = tok.encode("2021", 8, end=True)  # 2 0 2 1 </s> <pad> <pad> <pad>
    assert tok.display_tokens(ids) == ["2", "0", "2", "1", "</s>"]
    assert tok.display_tokens(ids[:3]) == ["2", "0", "2"]  # no end token: one label per id


def test_every_format_of_a_day_in_range_is_a_date():
    every_day_of = [datetime.date(y, 1, 1) + datetime.timedelta(days=i) for y in (1950, 2000, 2023, 2049)
                    for i in range(365 + (y % 4 == 0))]  # both kinds of February, both ends of the range
    every_eleventh = [dates.FIRST_DAY + datetime.timedelta(days=i) for i in range(0, 36525, 11)]
    for day in every_day_of + every_eleventh:
        for write in dates.FORMATS:
            assert dates.no_such_date(write(day)) is None, write(day)
        assert dates.no_such_date(day.isoformat()) is None


@pytest.mark.parametrize("text, reason", [
    ("2021-13-45", "month 13 does not exist"),
    ("2021/0/3", "month 0 does not exist"),
    ("13/1/21", "month 13 does not exist"),  # M/D/YY: slashed dates are month first
    ("2/29/23", "february 2023 has no day 29"),
    ("31.04.2020", "april 2020 has no day 31"),
    ("February 30, 2021", "february 2021 has no day 30"),
    ("the 31st of june 1999", "june 1999 has no day 31"),
    ("monday, february 30th, 2021", "february 2021 has no day 30"),
    ("30-FEB-21", "february 2021 has no day 30"),
    ("Feb. 29th '23", "february 2023 has no day 29"),
    ("1 jan 1949", "1949-01-01 is outside the years the model knows (1950-2049)"),
    ("2050/1/1", "2050-01-01 is outside the years the model knows (1950-2049)"),
])
def test_no_such_date_names_the_problem(text, reason):
    assert dates.no_such_date(text) == reason


@pytest.mark.parametrize("text", ["hello", "", "2/29/24", "Feb. 29th '24", "march 5 1999", "1/2/3/4", "12-13-2021"])
def test_no_such_date_leaves_other_texts_to_the_model(text):
    assert dates.no_such_date(text) is None  # a real day, or a shape the task does not know
