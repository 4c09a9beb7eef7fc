"""The one exception type the user sees as a single line, not a traceback."""


class UserError(Exception):
    """Something the user can fix (config, data, checkpoint, hardware choice).

    `main()` prints its message as one line on stderr and exits non-zero. Raise it with a
    message that names what was wrong and what would be valid.
    """

    # True when every rank meets the same error (config, data files): only rank 0 reports it.
    same_on_all_ranks = False
