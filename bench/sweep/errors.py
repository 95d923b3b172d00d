"""The one exception the sweep raises for conditions a person must fix (printed without a traceback)."""


class SweepError(RuntimeError):
    pass
