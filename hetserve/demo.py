"""``make demo``: the main job on the bundled example, end to end.

Each step prints what it does. Steps that need a later layer (planner, simulator, engine,
server) run when that layer is installed in this package version.
"""

from __future__ import annotations

import sys

from rich.console import Console

from hetserve.cli.main import main as cli

console = Console()


def step(title: str, argv: list[str]) -> None:
    console.rule(f"[bold]{title}[/]  [dim]hetserve {' '.join(argv)}[/]")
    code = cli(argv)
    if code:
        console.print(f"[red]step failed with exit code {code}[/]")
        sys.exit(code)


def main() -> None:
    step("1. the pool", ["describe", "cluster", "hexgen2-het1"])
    step("2. the model", ["describe", "model", "llama-2-70b"])
    step("3. the traffic", ["describe", "workload", "azure-conv"])


if __name__ == "__main__":
    main()
