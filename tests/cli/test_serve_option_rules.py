"""``hetserve serve``'s rules between options, through the CLI's ``main`` with the work stubbed out
(``bad_input_runner``): a refused combination is one line naming the options, a legitimate one is
taken (the command reaches ``_start_and_serve``)."""

from __future__ import annotations

import pytest

from .bad_input_runner import Case, check_case

SERVE = "serve --plan {d}/tiny.json --model {d}/m"
ADMIN = ("admin", ("0123456789abcdef0123\n", 0o600))  # an admin key file only its owner reads

REFUSED = [
    # the HTTP port is the user's own; the range is where hetserve's other listeners take theirs
    Case("port-inside-range", SERVE + " --port 24000 --port-range 24000-24009",
         ("--port", "--port-range 24000-24009", "got 24000")),
    Case("port-at-range-end", SERVE + " --port 24009 --port-range 24000-24009", ("--port", "--port-range")),
    # nothing would read the re-plan options: no failure re-plan, no admin key to POST /admin/replan
    Case("replan-workload-alone", SERVE + " --port 0 --replan-workload {d}/t.csv",
         ("--replan-workload", "--replan-on-failure", "an admin key")),
    Case("replan-time-alone", SERVE + " --port 0 --replan-time-limit 5", ("--replan-time-limit", "--admin-key")),
    # Ray actors are placed once: no re-plan there, admin key or not
    Case("replan-time-on-ray", SERVE + " --port 0 --backend ray --admin-key-file {d}/admin --replan-time-limit 5",
         ("--replan-time-limit", "local backend"), dict([ADMIN])),
    Case("replan-workload-bad-with-admin", SERVE + " --port 0 --admin-key-file {d}/admin --replan-workload {d}/no.csv",
         ("no.csv",), dict([ADMIN])),
]

TAKEN = [
    Case("port-below-range", SERVE + " --port 23999 --port-range 24000-24009", accepted="the ranges do not overlap"),
    Case("port-0-with-range", SERVE + " --port 0 --port-range 24000-24009", accepted="the OS picks the HTTP port"),
    Case("replan-options-with-admin", SERVE + " --port 0 --admin-key-file {d}/admin --replan-time-limit 5 "
         "--replan-workload {d}/t.csv", files=dict([ADMIN]), accepted="POST /admin/replan reads them"),
    Case("replan-options-on-failure", SERVE + " --port 0 --replan-on-failure --replan-time-limit 5",
         accepted="a failure's re-plan reads them"),
]


@pytest.mark.parametrize("case", REFUSED + TAKEN, ids=[c.id for c in REFUSED + TAKEN])
def test_serve_option_rule(case, tmp_path):
    check_case(case, tmp_path / "case")
