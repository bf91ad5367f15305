"""The bad-input corpus: command lines a new user might type, with wrong files, fields, numbers and
options, and what the CLI must say to each (one line naming the file / field / option and what was
expected, exit code 2, no traceback). A few inputs look wrong but are legitimate: those cases say
why they are accepted.

``python -m tests.cli.bad_inputs`` prints every case's outcome as a table; ``test_bad_input_corpus``
fails when a case tracebacks, is accepted without a reason, or its line lacks the words it must hold.
Each case runs in a folder of its own holding ``BASE_FILES`` (a good cluster, model, plan and trace),
so a case names only what it breaks.
"""

from __future__ import annotations

from .bad_input_runner import BASE_FILES
from .bad_inputs_commands import COMMAND_CASES
from .bad_inputs_specs import SPEC_CASES

CASES = SPEC_CASES + COMMAND_CASES


def main() -> int:
    """Run every case; print case, outcome and the first line of what the CLI said."""
    import tempfile
    from pathlib import Path

    from .bad_input_runner import run_case

    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as root:
        for case in CASES:
            r = run_case(case, Path(root) / case.id, BASE_FILES)
            outcome = r.outcome
            if r.outcome == "accepted" and case.accepted:
                outcome = "accepted (legit)"
            elif r.outcome == "accepted":
                outcome = "accepted (SILENT)"
            elif r.outcome == "error" and r.missing:
                outcome = "error (vague)"
            counts[outcome] = counts.get(outcome, 0) + 1
            print(f"{case.id:<36} {outcome:<18} {r.message[:150]}")
    print(f"\n{len(CASES)} cases: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0 if set(counts) <= {"error", "accepted (legit)"} else 1


if __name__ == "__main__":
    raise SystemExit(main())
