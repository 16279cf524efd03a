"""What the date model refuses, and outputs that are no date: the markers `attnkit translate` prints in
place of a translation, and the explorer notes beside one."""

from attnkit._messages import field
from attnkit.dates.task import is_task_date, no_such_date


def refusal(translator, text):
    """The marker of an input the model cannot translate, or None (the explorer notes it too)."""
    if not text.strip():
        return "<empty>"
    if len(text) > translator.source_length:
        return f"<too long: {len(text)} characters, the model takes at most {translator.source_length}>"
    unknown = translator.unknown_characters(text)
    if unknown:
        return f"<unknown characters: {field(unknown)}>"
    problem = no_such_date(text)
    if problem:  # the model would still answer some date, with confidence
        return f"<no such date: {problem}>"
    return None


def output_marker(output):
    """The marker of a model's output that is not a date of the task's years, or None (the explorer
    notes it too)."""
    return None if is_task_date(output) else f"<not a date: {field(output)}>"
