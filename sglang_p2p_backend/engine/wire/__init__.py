"""The control channel's wire: typed messages, field checks, authentication, pair secrets, the agreement two ranks compare."""
