"""Command line: ``python -m nvfp4_indexer.conformance ...`` (also mounted as ``nvfp4-indexer conformance``
and ``nvfp4-indexer golden``).

    conformance run [--backend B] [--smoke | --full] [--seed N] [--checks a,b] [--case GLOB]
                    [--json] [--save-failures DIR] [--record FILE] [--interpret] [--strict]
    conformance replay CASE.npz [--backend B] [--oracle]
    conformance golden write DIR [--seed N] [--force]
    conformance golden verify [DIR] [--backend B] [--oracle | --no-oracle]
    conformance list

``run`` is the default subcommand (``python -m nvfp4_indexer.conformance --smoke`` works). Exit status: 0 when
every check passed, 1 on any failure (``--strict``: also on skipped checks), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SUBCOMMANDS = ("run", "replay", "golden", "list")
MODULE_CMD = f"python -m {__package__}"  # this harness's command line, under any package name


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="reference",
                   help="reference | triton | triton-fp8 | module:attr (a Backend of this "
                        "harness or a factory of one; see docs/conformance.md). Default: "
                        "reference")
    p.add_argument("--device", default=None,
                   help="device of the backend's tensors (default: cuda for triton when "
                        "available, else cpu)")
    p.add_argument("--interpret", action="store_true",
                   help="run Triton kernels in the interpreter on the CPU (sets "
                        "TRITON_INTERPRET=1 before Triton is imported)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document (schema in docs/conformance.md) instead of "
                        "tables")
    p.add_argument("--json-cases", action="store_true",
                   help="with --json: include every case's result")
    p.add_argument("--max-failures", type=int, default=5, metavar="N",
                   help="failures kept per case (default 5)")
    p.add_argument("--strict", action="store_true",
                   help="a skipped check (op missing or not implemented) fails the run")
    p.add_argument("--no-progress", action="store_true", help="no progress on stderr")


def _outputs(p: argparse.ArgumentParser) -> None:
    """Files a run or a verify may write besides its report."""
    p.add_argument("--save-failures", default=None, metavar="DIR",
                   help="save every failing case as DIR/<case>.npz + .json")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="also write a markdown record (date, GPU, commit, table) to FILE")


def _seed(text: str) -> int:
    """argparse type of ``--seed``: a non-negative integer (numpy's generators need one)."""
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    if val < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {val}")
    return val


def build_parser(prog: str = MODULE_CMD) -> argparse.ArgumentParser:
    """The harness's parser; ``prog`` names it in usage lines (``nvfp4-indexer conformance``
    or ``nvfp4-indexer`` when mounted, so that ``golden`` reads ``nvfp4-indexer golden``)."""
    ap = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Conformance harness of nvfp4_indexer (SPEC 9): random paged engine\n"
                    "states, bit-exact and tie-aware checks, CUDA-graph replays, golden vectors.",
        epilog="quick run (CI sizes: about 20 s on 2 CPU cores, about 70 s with the Triton "
               "interpreter; 'run' is the default subcommand):\n"
               "  %(prog)s --smoke\n"
               "  %(prog)s --smoke --backend triton --interpret\n"
               "all options of a subcommand: %(prog)s run --help")
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate seeded cases and check a backend")
    _common(run)
    prof = run.add_mutually_exclusive_group()
    prof.add_argument("--smoke", dest="profile", action="store_const", const="smoke",
                      help="CI sizes (about 20 s on 2 cores with the reference; the Triton "
                           "interpreter only with --backend triton --interpret, about 70 s)")
    prof.add_argument("--full", dest="profile", action="store_const", const="full",
                      help="GPU sizes: contexts up to 128K tokens, batches up to 64")
    prof.add_argument("--profile", dest="profile", choices=("smoke", "default", "full"))
    run.set_defaults(profile="default")
    run.add_argument("--seed", type=_seed, default=0, help="run seed (default 0)")
    run.add_argument("--checks", default=None,
                     help="comma-separated checks to run (default: all; see 'list')")
    run.add_argument("--case", default=None, metavar="GLOB",
                     help="only cases whose name matches, e.g. 'decode/ties/*'")
    _outputs(run)
    run.set_defaults(func=cmd_run)

    rep = sub.add_parser("replay", help="run a saved case file on a backend")
    _common(rep)
    rep.add_argument("case_file", help="CASE.npz (or its .json)")
    rep.add_argument("--oracle", action="store_true",
                     help="recompute the expected outputs with the reference instead of "
                          "using the saved ones")
    rep.set_defaults(func=cmd_replay)

    gold = sub.add_parser("golden", help="write or verify golden vectors")
    gsub = gold.add_subparsers(dest="golden_command", required=True)
    gw = gsub.add_parser("write", help="write a golden set (reference outputs)")
    gw.add_argument("dir", help="output directory (e.g. /tmp/golden)")
    gw.add_argument("--seed", type=_seed, default=None, help="generator seed")
    gw.add_argument("--json", action="store_true", help="print the manifest summary as JSON")
    gw.add_argument("--force", action="store_true",
                    help="replace the files of an existing, non-empty DIR")
    gw.set_defaults(func=cmd_golden_write)
    gv = gsub.add_parser("verify", help="check a backend against a golden set")
    _common(gv)
    gv.add_argument("dir", nargs="?", default=None,
                    help="golden directory (default: the shipped set, golden/v2 in this package)")
    gv.add_argument("--oracle", dest="oracle", action="store_true", default=None,
                    help="also require the reference to reproduce every stored array bit for "
                         "bit (default with --backend reference)")
    gv.add_argument("--no-oracle", dest="oracle", action="store_false")
    gv.add_argument("--case", default=None, metavar="GLOB", help="only matching cases")
    _outputs(gv)
    gv.set_defaults(func=cmd_golden_verify)

    ls = sub.add_parser("list", help="list checks, profiles and distributions")
    ls.set_defaults(func=cmd_list)
    return ap


def main(argv=None, prog: str = MODULE_CMD) -> int:
    """Entry point; ``argv`` without the program name, ``prog`` the name usage lines show.
    Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]
    args = build_parser(prog).parse_args(argv)
    if getattr(args, "interpret", False):
        _enable_interpreter()
    try:
        return args.func(args)
    except _UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def golden_main(argv=None) -> int:
    """``nvfp4-indexer golden ...``: the ``golden`` subcommand."""
    return main(["golden", *(sys.argv[1:] if argv is None else argv)], prog="nvfp4-indexer")


class _UsageError(Exception):
    pass


def _enable_interpreter() -> None:
    """TRITON_INTERPRET=1 must be set before kernels are defined (``@triton.jit`` reads it)."""
    already = [m for m in sys.modules if m.startswith("nvfp4_indexer.triton.")]
    if already and os.environ.get("TRITON_INTERPRET") != "1":
        print(f"{__package__}: warning: Triton kernels were imported before --interpret; set "
              "TRITON_INTERPRET=1 in the environment instead", file=sys.stderr)
    os.environ["TRITON_INTERPRET"] = "1"


def _backend(args):
    from .backends import load_backend
    device = args.device
    if args.interpret and device is None:
        device = "cpu"
    try:
        return load_backend(args.backend, device)
    except (RuntimeError, ValueError, ImportError, AttributeError) as e:
        msg = str(e)  # load_backend's messages may already name the option
        raise _UsageError(msg if msg.startswith("--backend") else
                          f"--backend {args.backend}: {msg}") from e


def _console():
    from rich.console import Console
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120,
                   highlight=False)


def _save_failures(results, directory, backend_name) -> int:
    from .cases import save_case
    n = 0
    for r in results:
        if r.ok or r.case_obj is None:
            continue
        path = save_case(directory, r.case_obj, r.expected, failures=r.failures,
                         backend=backend_name)
        for f in r.failures:
            f.case_file = str(path)
        n += 1
    return n


def _finish(args, command, results, backend, started, *, profile=None, seed=None,
            title="", extra=None, rerun=None) -> int:
    from .report import document, record_markdown, render, summarize
    bdesc = backend.describe()
    bdesc["spec"] = args.backend  # how to name this backend on a command line
    saved = 0
    if getattr(args, "save_failures", None):
        saved = _save_failures(results, args.save_failures, args.backend)
    sums = summarize(results)
    ok = all(s.ok for s in sums) and not (args.strict and any(s.cases_skipped for s in sums))
    if getattr(args, "record", None):
        record_markdown(args.record, results, command=command, backend=bdesc, profile=profile,
                        seed=seed, duration=time.time() - started)
    if args.json:
        doc = document(command, results, backend=bdesc, profile=profile, seed=seed,
                       started=started, extra=extra, include_cases=args.json_cases)
        doc["ok"] = ok
        print(json.dumps(doc, indent=1, default=str))
    else:
        con = _console()
        render(con, results, title=title, backend=bdesc, strict=args.strict, rerun=rerun)
        if saved:
            con.print(f"saved {saved} failing case file(s) under {args.save_failures}")
    return 0 if ok else 1


def _rerun(args, command: str, options: str = "") -> str:
    """The command line that reruns one case (``{case}``: its name) of this run."""
    interp = " --interpret" if args.interpret else ""
    return f"{MODULE_CMD} {command} --backend {args.backend}{interp}{options} --case '{{case}}'"


def cmd_run(args) -> int:
    from .generator import PROFILES
    from .report import Progress
    from .suite import CHECKS, run_suite
    backend = _backend(args)
    checks = CHECKS if not args.checks else tuple(c.strip() for c in args.checks.split(","))
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise _UsageError(f"--checks: unknown {unknown}; expected some of {', '.join(CHECKS)}")
    started = time.time()
    with Progress(enabled=not args.no_progress) as prog:
        results = run_suite(backend, PROFILES[args.profile], args.seed, checks,
                            case_glob=args.case, max_failures=args.max_failures,
                            on_result=prog.case, on_check=prog.check)
    title = (f"conformance run: backend={backend.name} device={backend.device} "
             f"profile={args.profile} seed={args.seed}")
    rerun = _rerun(args, "run", f" --profile {args.profile} --seed {args.seed}")
    return _finish(args, "run", results, backend, started, profile=args.profile,
                   seed=args.seed, title=title, rerun=rerun)


def cmd_replay(args) -> int:
    from pathlib import Path

    from .cases import load_case, replay_case
    stem = Path(args.case_file).with_suffix("")
    missing = [str(stem.with_suffix(x)) for x in (".npz", ".json")
               if not stem.with_suffix(x).is_file()]
    if missing:  # a case is a .npz + .json pair: name what is absent
        raise _UsageError(f"case file {args.case_file}: no such file {' or '.join(missing)}")
    backend = _backend(args)
    started = time.time()
    try:
        case, doc = load_case(args.case_file)
    except (OSError, ValueError) as e:
        raise _UsageError(str(e)) from e
    r = replay_case(args.case_file, backend, max_failures=args.max_failures,
                    oracle=args.oracle)
    title = f"replay {case.name} (seed {case.seed}, op {case.op}) on {backend.name}"
    return _finish(args, "replay", [r], backend, started, seed=case.seed, title=title,
                   extra={"case_file": str(args.case_file)})


def cmd_golden_write(args) -> int:
    from pathlib import Path

    from .golden import GOLDEN_SEED, golden_size, write_golden
    d = Path(args.dir)
    if d.exists() and not d.is_dir():
        raise _UsageError(f"golden write {args.dir}: not a directory")
    if d.is_dir() and any(d.iterdir()) and not args.force:
        raise _UsageError(f"golden write {args.dir}: the directory exists and is not empty "
                          "(a golden set is versioned: write a new DIR, or pass --force to "
                          "replace its files)")
    started = time.time()
    m = write_golden(args.dir, GOLDEN_SEED if args.seed is None else args.seed)
    size = golden_size(args.dir)
    summary = {"dir": args.dir, "cases": len(m["cases"]), "files": m["files"],
               "bytes": size, "seconds": round(time.time() - started, 2),
               "spec_version": m["spec_version"], "seed": m["generator"]["seed"]}
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"wrote {summary['cases']} cases, {len(m['files'])} files, {size / 1e6:.2f} MB "
              f"to {args.dir} in {summary['seconds']} s (SPEC {m['spec_version']}, seed "
              f"{summary['seed']})")
    return 0


def cmd_golden_verify(args) -> int:
    from .golden import DEFAULT_DIR, verify_golden
    from .report import Progress
    backend = _backend(args)
    directory = args.dir or str(DEFAULT_DIR)
    oracle = args.oracle if args.oracle is not None else backend.name == "reference"
    started = time.time()
    try:
        with Progress(enabled=not args.no_progress) as prog:
            results, manifest = verify_golden(directory, backend, oracle_check=oracle,
                                              max_failures=args.max_failures,
                                              on_result=prog.case, case_glob=args.case)
    except (OSError, ValueError) as e:
        raise _UsageError(str(e)) from e
    title = (f"golden verify {directory} (SPEC {manifest['spec_version']}, seed "
             f"{manifest['generator']['seed']}): backend={backend.name} device={backend.device}")
    rerun = _rerun(args, f"golden verify {directory}")
    return _finish(args, "golden-verify", results, backend, started,
                   seed=manifest["generator"]["seed"], title=title,
                   extra={"golden_dir": directory, "oracle": oracle}, rerun=rerun)


def cmd_list(args) -> int:
    from .generator import DISTRIBUTIONS, PROFILES
    from .suite import CHECK_DOCS, CHECKS
    print("checks:")
    for c in CHECKS:
        print(f"  {c:8s} {CHECK_DOCS[c]}")
    print("profiles: " + ", ".join(PROFILES))
    print("distributions: " + ", ".join(DISTRIBUTIONS))
    return 0
