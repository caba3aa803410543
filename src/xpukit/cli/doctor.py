"""``xpukit doctor``: report this machine's torch build, devices, extras, environment and problems."""

from __future__ import annotations

import argparse

from xpukit.cli.output import emit_json


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``doctor`` subcommand."""
    parser = sub.add_parser(
        "doctor",
        help="what this machine has, and known-bad setups",
        description="Report the torch build, devices and their facts (bf16/fp16/fp64, memory, whether "
        "free memory can be queried), installed extras, the environment variables that matter, and "
        "known-bad setups. Exit 0 when healthy, 1 when a blocking problem was found.",
        epilog="Examples:\n  xpukit doctor\n  xpukit doctor --json > report.json\n"
        "  xpukit doctor --selftest   # run tiny real ops on each device",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON (stable schema)")
    parser.add_argument(
        "--selftest", action="store_true", help="also run small real operations on every device"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the report; exit 1 when it found a blocking problem."""
    from xpukit.doctor.report import run_doctor

    report = run_doctor()
    if args.selftest:
        from dataclasses import replace

        from xpukit.doctor.selftest import results_to_dict, run_selftest

        results = run_selftest(report.machine)
        checks = results_to_dict(results)
        failed = [c for c in checks if not c["ok"]]
        # A failure the device's facts predict (fp64 on Arc A, mem_get_info on an iGPU) is
        # information; one they do not predict means the facts or the setup are wrong.
        unexpected = [r for r in results if r.unexpected_failure]
        summary = f"{len(checks) - len(failed)}/{len(checks)} checks passed" + (
            "; failed: " + ", ".join(f"{c['device']} {c['check']}" for c in failed) if failed else ""
        )
        if unexpected:
            summary += f" ({len(unexpected)} against the recorded facts)"
        report = replace(
            report,
            extras={"selftest": {"summary": summary, "checks": checks, "passed": not unexpected}},
        )
    if args.json:
        emit_json(report.to_dict())
    else:
        print(report.render())
    selftest_ok = report.extras.get("selftest", {}).get("passed", True)
    return 0 if report.healthy and selftest_ok else 1
