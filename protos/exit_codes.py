"""How a trainer process ends: the contract between the trainer and whoever runs it.

The trainer returns one of these; the launcher's scheduler reads them (`after_exit`), and
`submit`/`kitchen watch` exit with the code of the job's final state. One home for the
numbers, so a new job kind cannot pick its own.
"""

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    FAILED = 1  # a crash or a failed run: the launcher retries it
    BAD_CONFIG = 2  # bad config or input; the message names the field or file: no retry
    PREEMPTED = 75  # stopped on request (SIGTERM / the launcher's stop), checkpoint saved
    CANCELLED = 130  # the job was cancelled (submit, kitchen watch); the trainer never uses it
