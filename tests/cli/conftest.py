"""Fixtures for the command-line tests."""

import functools

import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_parser_per_module():
    """``hetserve``'s parser built once per test module rather than at every ``main()`` call, as a
    command line builds it once per process: its options take 9 ms to build, and these tests call
    ``main()`` some 700 times. A parse leaves the parser as it was (what it finds goes on the
    namespace), and none of these tests changes what the parser is built from."""
    from hetserve.cli import main

    build = main.build_parser
    main.build_parser = functools.cache(build)
    yield
    main.build_parser = build
