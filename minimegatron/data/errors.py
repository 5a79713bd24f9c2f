"""The one exception type of the data pipeline.

Every problem with data on disk (a missing or corrupt ``.bin``/``.idx`` pair, a bad JSONL line,
an unreadable tokenizer file, a split too small to hold one sample) raises ``DataError``. Its
message always names the file (and, for JSONL, the line number) and says what is wrong, so a
learner can fix the input without reading a traceback.

``DataError`` subclasses ``ValueError``: callers that already catch ``ValueError`` for bad input
keep working.
"""


class DataError(ValueError):
    """Bad data input: the message names the path and the problem."""


__all__ = ["DataError"]
