"""ttrank: compile a new network fast by ranking and reusing schedules tuned for other networks."""

__version__ = "0.1.0"
