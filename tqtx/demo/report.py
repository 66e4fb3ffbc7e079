"""The demo's printed summary: the timing table, the journal records, the verdict."""
from __future__ import annotations


def _gbps(nbytes, sec):
    return nbytes / sec / 1e9 if sec > 0 else float("inf")


def print_timings(con, args, n: int, total_payload: int, t_put: float, save: dict,
                  restore: dict) -> None:
    """The put / save / restore table (keys, bytes, seconds, GB/s)."""
    from rich.table import Table

    t = Table(title="tqtx demo", show_header=True)
    t.add_column("step")
    t.add_column("keys", justify="right")
    t.add_column("bytes", justify="right")
    t.add_column("seconds", justify="right")
    t.add_column("GB/s", justify="right")
    t.add_row(f"put ({args.units_before} units)", str(n), f"{total_payload:,}",
              f"{t_put:.3f}", f"{_gbps(total_payload, t_put):.2f}")
    t.add_row(f"save (dump_data_by_key, {save['shards']} shards)", str(save["keys"]),
              f"{save['bytes']:,}", f"{save['seconds']:.3f}",
              f"{_gbps(save['bytes'], save['seconds']):.2f}")
    t.add_row(f"restore (load_data_by_key, {args.units_after} units)", str(restore["keys"]),
              f"{restore['bytes']:,}", f"{restore['seconds']:.3f}",
              f"{_gbps(restore['bytes'], restore['seconds']):.2f}")
    con.print(t)


def print_journals(con, journals: dict) -> None:
    """One line counting the records of :func:`tqtx.demo.checks.read_journals`."""
    restores, jshow = journals["restores"], journals["journal_show"]
    states = {}
    for r in restores:
        states[r["state"]] = states.get(r["state"], 0) + 1
    con.print(f"journal: controller (after) restores={len(restores)} {states}; "
              f"controller (before) dumps={len(journals['dumps'])}; dump journal publications="
              f"{len(journals['publications'])} reads={len(journals['reads'])}"
              + (f"; `tqtx journal show --json`: {len(jshow['restores'])} restores, "
                 f"{len(jshow['publications'])} publications" if jshow else ""))


def print_verdict(con, problems: list[str], checks: int, restored: int, seconds: float) -> int:
    """VERIFICATION PASSED / FAILED (with the problems); the demo's exit code."""
    if problems:
        con.print(f"[bold red]VERIFICATION FAILED[/bold red] ({len(problems)} problems):")
        for p in problems:
            con.print(f"  - {p}")
        return 1
    con.print(f"[bold green]VERIFICATION PASSED[/bold green]: {checks} checks on "
              f"{restored} restored samples ({seconds:.1f}s total)")
    return 0


def print_next_steps(con, dump_dir: str, state_after: str) -> None:
    """Commands to look at a dump kept with ``--keep``."""
    con.print(f"dump kept in {dump_dir}; try:")
    con.print(f"  tqtx inspect {dump_dir}")
    con.print(f"  tqtx verify {dump_dir}")
    con.print(f"  tqtx journal show {dump_dir}")
    con.print(f"  tqtx journal show --state-dir {state_after}")
