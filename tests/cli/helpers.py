"""What the CLI tests check of every user error: one line on stderr."""


def assert_one_error_line(err: str, words, case) -> None:
    """stderr is exactly one line, 'fastwan: error: ...', holding each of ``words``, and no traceback."""
    assert err.endswith("\n") and err.count("\n") == 1, (case, err)
    assert err.startswith("fastwan: error: ") and "Traceback" not in err, (case, err)
    for w in words:
        assert w in err, (case, w, err)
