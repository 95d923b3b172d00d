"""A clock a test moves by hand, for the bounds that objects taking a `clock` callable keep."""


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
