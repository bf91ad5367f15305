"""What a refused command prints: one line on stderr, naming what was wrong, never a traceback."""


def one_line_error(capsys) -> str:
    """The command's stderr, checked to be one line and no traceback."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err
