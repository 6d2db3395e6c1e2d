"""``python -m tvm_rmsquant``: build, list, inspect, self-check, benchmark and tune kernel bundles."""

from __future__ import annotations

import argparse
import errno
import json
import sys
from pathlib import Path
from typing import List, Optional

from .bundle_format import default_bundle_dir, sha256_file
from .target import DEFAULT_ARCHS, TARGETS, scheduling_target


def _parse_hidden(text: str) -> List[int]:
    try:
        values = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hidden={text!r}: expected integers such as 4096,7168") from None
    if not values or any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError(f"--hidden={text!r}: expected positive integers such as 4096,7168")
    return values


def _parse_knobs(text: str):
    """name=int pairs; ``_build`` checks them against the rules' spaces for the build's target.
    A refusal is one line and exit 2: argparse's own would print the usage first."""
    try:
        return {key: int(value) for key, value in (pair.split("=") for pair in text.split(",") if pair)}
    except ValueError:
        print(f"error: --knobs={text!r}: expected name=int pairs such as groups_per_thread=8,vector=8", file=sys.stderr)
        raise SystemExit(2) from None


def _parse_archs(text: str):
    """A comma-separated arch list that one schedule can serve; a refusal is one line and exit 2,
    as for --knobs."""
    from .target import parse_archs, scheduling_target

    try:
        archs = parse_archs(text)
        scheduling_target(archs)
        return archs
    except ValueError as error:
        print(f"error: --arch={text!r}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _parse_spec(text: str):
    from .spec import VariantSpec

    try:
        return VariantSpec.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--spec={text!r}: {error}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tvm_rmsquant", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="offline build of a kernel bundle (needs the [build] extra and nvcc)")
    build.add_argument("--preset", default="default", choices=["default", "all"])
    build.add_argument("--hidden", type=_parse_hidden, help="only these hidden sizes, e.g. 4096,7168")
    build.add_argument("--dtype", action="append", choices=["bf16", "fp16", "fp32"], help="only these dtypes (repeatable)")
    build.add_argument("--out", default=str(default_bundle_dir()), help="bundle directory (default: %(default)s)")
    build.add_argument("-j", "--jobs", type=int, default=2, help="parallel lowering processes and nvcc invocations")
    build.add_argument("--cache", help="build cache directory (default: ~/.cache/tvm_rmsquant)")
    build.add_argument("--knobs", type=_parse_knobs, default={}, help="override schedule knobs where valid, e.g. groups_per_thread=8")
    build.add_argument("--no-pdl", action="store_true",
                       help="launch the kernels without programmatic dependent launch (on by default: each kernel "
                            "waits on griddepcontrol before its first read, so it may launch while the previous one ends)")
    build.add_argument("--arch", type=_parse_archs, default=",".join(DEFAULT_ARCHS),
                       help=f"comma-separated GPU archs every library holds SASS for, of {','.join(TARGETS)} (default: %(default)s); "
                            "tuning records are matched against the first one's compute capability")
    tuning = build.add_mutually_exclusive_group()
    tuning.add_argument("--tuning-db", type=Path, help="tuning database to take measured schedules from (default: the one shipped with the package)")
    tuning.add_argument("--no-tuning", action="store_true", help="hand-picked schedules only")
    build.add_argument("--tuning-gpu", help="use only tuning records measured on this GPU, e.g. 'NVIDIA H200'")

    listing = commands.add_parser("list", help="variants in a bundle")
    listing.add_argument("--bundle", type=Path)

    inspect = commands.add_parser("inspect", help="one variant: spec, schedule knobs, registers/spills, source")
    inspect.add_argument("name")
    inspect.add_argument("--bundle", type=Path)

    bench = commands.add_parser("bench", help="GPU benchmark against peers (CSV, markdown table, plot)")
    bench.add_argument("--bundle", type=Path)
    bench.add_argument("--hidden", type=_parse_hidden, default=[2048, 4096, 5120, 7168, 8192])
    bench.add_argument("--rows", type=_parse_hidden, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768])
    bench.add_argument("--providers", default="ours,torch_eager", help="comma-separated: ours, torch_eager, torch_compile, triton, flashinfer "
                       "(python3 scripts/build_flashinfer_peer.py builds it)")
    bench.add_argument("--formats", default="row:fp32,col:fp32,col:ue8m0",
                       help="layout:format pairs; layout:format:wf32 takes an fp32 norm weight (16-bit --dtype only)")
    bench.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    bench.add_argument("--group", type=int, help="the grid's group size G (default 128; 32 for packed UE8M0 at G = 32 and tiled:mxfp8)")
    bench.add_argument("--slow-rows", type=_parse_hidden, help="M values at which torch_eager/torch_compile run (default: all)")
    bench.add_argument("--overhead", action="store_true", help="also measure eager host overhead against torch.add")
    bench.add_argument("--pairs", action="store_true",
                       help="instead of the grid: bf16 GEMM -> op pairs in a CUDA graph (residual, col fp32), per provider; for PDL")
    bench.add_argument("--out", type=Path, default=Path("bench-results"))

    tune = commands.add_parser("tune", help="schedule tuning: build candidates (CPU), measure them (GPU), report, record").add_subparsers(dest="tune_command", required=True)
    tune_build = tune.add_parser("build", help="build a candidate bundle (needs the [build] extra and nvcc)")
    tune_build.add_argument("--spec", action="append", type=_parse_spec, help="variant name, e.g. bf16_k4096_g128_col_fp32 (repeatable; default: the tuning set)")
    tune_build.add_argument("--strategy", default="exhaustive", choices=["exhaustive", "random", "evolve", "recorded"],
                            help="recorded: the tuning database's picks, to confirm them against the hand-picked schedules")
    tune_build.add_argument("--trials", type=int, default=8, help="candidates per spec for random/evolve (the hand-picked one is always added)")
    tune_build.add_argument("--results", type=Path, help="earlier results JSON that evolve proposes from")
    tune_build.add_argument("--seed", type=int, default=0)
    tune_build.add_argument("--out", type=Path, required=True, help="candidate bundle directory")
    tune_build.add_argument("-j", "--jobs", type=int, default=2)
    tune_build.add_argument("--cache", type=Path)
    tune_measure = tune.add_parser("measure", help="check and time a candidate bundle's kernels on the GPU (torch + tvm-ffi only)")
    tune_measure.add_argument("bundle", type=Path)
    tune_measure.add_argument("--rows", type=_parse_hidden, help="M values (default: every M bucket's timed values)")
    tune_measure.add_argument("--spec", action="append", type=_parse_spec, help="only this spec's candidates (repeatable)")
    tune_measure.add_argument("--out", type=Path, required=True, help="results JSON to write")
    tune_report = tune.add_parser("report", help="ranking, knob heat-map and best-so-far plots from results")
    tune_report.add_argument("results", type=Path)
    tune_report.add_argument("--out", type=Path, default=Path("tune-report"))
    tune_record = tune.add_parser("record", help="merge the results' best schedule per (spec, M bucket) into a tuning database")
    tune_record.add_argument("results", type=Path)
    tune_record.add_argument("--db", type=Path, help="database file (default: the one shipped with the package)")

    check = commands.add_parser("self-check", help="CPU check: the tensor expression (llvm) against the torch reference")
    check.add_argument("--hidden", type=_parse_hidden, default=[128, 4096])
    return parser


def _build(args) -> int:
    from .presets import preset
    from .schedules import check_overrides, overriding

    # A knob that no rule has for any spec a build can make (preset 'all') on this target is
    # refused; one that some rule has is applied wherever it fits (``overriding``).
    schedule_target = scheduling_target(args.arch)
    reason = check_overrides(args.knobs, preset("all"), schedule_target)
    if reason is not None:
        knobs = ",".join(f"{name}={value}" for name, value in args.knobs.items())
        print(f"error: --knobs={knobs!r}: {reason}", file=sys.stderr)
        return 2

    try:
        from .codegen import bundle as builder
        from .codegen.nvcc import NvccError, find_nvcc

        find_nvcc()
    except ImportError as error:
        print(f"error: the build step needs the [build] extra (pip install 'tvm-rmsquant[build]'): {error}", file=sys.stderr)
        return 2
    except NvccError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"error: -j/--jobs={args.jobs}: expected a positive integer", file=sys.stderr)
        return 2
    from .bundle_format import default_cache_dir

    # Strings, not argparse's Path: Path('') is '.', and --out '' would build into the working directory.
    directories = {"--out": args.out, "--cache": str(default_cache_dir()) if args.cache is None else args.cache}
    for flag, path in directories.items():
        reason = "an empty path; give a directory, e.g. build/bundle" if path == "" else builder.unwritable(Path(path))
        if reason is not None:
            print(f"error: {flag}={path!r}: {reason}", file=sys.stderr)
            return 2
    out, cache = Path(directories["--out"]), Path(directories["--cache"])
    try:
        specs = preset(args.preset, hidden=args.hidden, dtypes=args.dtype)
    except ValueError as error:
        print(f"error: unsupported spec: {error}", file=sys.stderr)
        return 2

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .schedules.database import DEFAULT_DATABASE, DatabaseError, TuningDatabase, build_target

    tuned, extra = None, {}
    if not args.no_tuning:
        path = args.tuning_db or DEFAULT_DATABASE
        try:
            database = TuningDatabase.load(path)
        except DatabaseError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        tools = builder.toolchain(args.arch, not args.no_pdl)
        target = build_target(tools, schedule_target.capability, args.tuning_gpu)
        kernel_digest = builder.KernelDigests(cache, tools)
        tuned, rejected = database.for_build(target, {spec.name for spec in specs}, kernel_digest)
        print(f"tuning database {path}: {len(tuned.records)} records used, {len(rejected)} rejected")
        for reason in rejected:
            print(f"  rejected {reason}")
        extra = {"tuning": {"database_sha256": sha256_file(path), "records": sorted(f"{spec} M<={rows}" for spec, rows in tuned.records)}}
    choose = overriding(args.knobs, schedule_target)
    libraries = builder.plan(specs, choose, tuned, args.arch)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False) as bar:
        tasks = {
            "lower": bar.add_task("lower (TVM)", total=sum(len(variants) for variants in libraries.values())),
            "compile": bar.add_task("compile (nvcc)", total=len(libraries)),
        }
        try:
            report = builder.build(
                specs, out, jobs=args.jobs, cache_dir=cache, choose=choose, tuned=tuned,
                progress=lambda stage, n: bar.advance(tasks[stage], n), extra=extra, archs=args.arch, pdl=not args.no_pdl,
            )
        except OSError as error:
            reason = "disk full" if error.errno == errno.ENOSPC else "a file could not be written or read"
            print(f"error: {reason} while building into {out} or its cache {cache}: {error}; nothing was published", file=sys.stderr)
            return 1
        except NvccError as error:
            print(f"error: {error}\nnothing was published", file=sys.stderr)
            return 1
    print(report.summary())
    return 0


def _open(path: Optional[Path]):
    from .loader import open_bundle

    return open_bundle(path)


def _list(args) -> int:
    bundle = _open(args.bundle)
    print(f"{bundle.path} ({len(bundle.names())} variants, {','.join(bundle.target_archs)})")
    for name in bundle.names():
        entry = bundle.entry(name)
        print(f"  {name:44s} {entry['rule']:14s} {json.dumps(entry['knobs'], sort_keys=True)}")
    return 0


def _inspect(args) -> int:
    bundle = _open(args.bundle)
    entry = bundle.entry(args.name)
    library = bundle.manifest["libraries"][entry["library"]]
    print(json.dumps({**entry, "source_path": str(bundle.path / library["source"]), "library_path": str(bundle.path / entry["library"])}, indent=2, sort_keys=True))
    return 0


def _bench_formats(text: str, dtype: str, group: int):
    """``--formats`` as (layout, format, weight_dtype) triples, each checked as the grid's spec
    at ``--group`` (``bench.grid_spec``); None after a one-line error."""
    from .bench import grid_spec

    formats = []
    for item in text.split(","):
        fields = item.split(":")
        if len(fields) not in (2, 3) or fields[2:] not in ([], ["wf32"]):
            print(f"error: --formats={text}: {item!r} is not layout:format or layout:format:wf32", file=sys.stderr)
            return None
        layout, fmt, weight_dtype = fields[0], fields[1], "fp32" if len(fields) == 3 else None
        try:
            grid_spec(dtype, None, False, layout, fmt, weight_dtype, group)
        except ValueError as error:
            print(f"error: --formats={text} --group={group}: {error}", file=sys.stderr)
            return None
        formats.append((layout, fmt, weight_dtype))
    return formats


def _bench(args) -> int:
    import torch

    from .bench import GRID_GROUP, grid_specs, missing_kernels, pair_spec, providers_by_name, run_benchmark

    group = GRID_GROUP if args.group is None else args.group
    formats = _bench_formats(args.formats, args.dtype, group)
    if formats is None:
        return 2
    if not torch.cuda.is_available():
        print(f"error: bench times CUDA kernels, and this torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    bundle = _open(args.bundle)
    try:
        providers = providers_by_name(args.providers.split(","), bundle)
    except ValueError as error:
        print(f"error: --providers={args.providers}: {error}", file=sys.stderr)
        return 2
    specs = [pair_spec(hidden) for hidden in args.hidden] if args.pairs else grid_specs(args.dtype, args.hidden, formats, group)
    missing = missing_kernels(bundle, specs) if any(provider.name == "ours" for provider in providers) else []
    if missing:
        asked = f"--hidden={','.join(map(str, args.hidden))}" + ("" if args.pairs else f" --formats={args.formats}")
        print(f"error: {asked}: bundle {bundle.path} has no kernel, static or dynamic K, for {', '.join(missing[:3])}"
              f"{' …' if len(missing) > 3 else ''} ({len(missing)} specs): build them "
              f"(`python3 -m tvm_rmsquant build --preset all` has every layout) or leave them out", file=sys.stderr)
        return 2
    if args.pairs:
        from .bench import gemm_pairs

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "pairs.json").write_text(json.dumps(gemm_pairs(bundle, providers, args.hidden, args.rows), indent=1))
        return 0
    run_benchmark(bundle, args.dtype, args.hidden, args.rows, formats, providers, args.out, args.slow_rows, group)
    if args.overhead:
        from .bench import host_overhead

        overhead = host_overhead(bundle)
        (args.out / "overhead.json").write_text(json.dumps(overhead, indent=1))
        for name, microseconds in overhead.items():
            print(f"host overhead {name:44s} {microseconds:6.2f} us/call  {microseconds / overhead['torch.add']:4.2f}x torch.add")
    return 0


def _tune(args) -> int:
    from . import tune

    if args.tune_command == "build":
        if args.trials < 1 or args.jobs < 1:
            print(f"error: --trials={args.trials} and -j/--jobs={args.jobs} must be positive integers", file=sys.stderr)
            return 2
        if args.strategy == "evolve" and args.results is None:
            print("error: --strategy=evolve proposes from measured results: pass --results RESULTS.json from `tune measure`", file=sys.stderr)
            return 2
        previous = _read_results(args.results) if args.results else None
        report = tune.build_candidates(args.spec or tune.TUNE_SPECS, args.strategy, args.trials, args.out, args.jobs, args.seed, previous, args.cache)
        print(report.summary())
        return 0
    if args.tune_command == "measure":
        try:
            tune.measure_candidates(_open(args.bundle), args.rows or tune.MEASURED_ROWS, out=args.out, specs=args.spec)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(f"wrote {args.out}")
        return 0
    results = _read_results(args.results)
    if args.tune_command == "report":
        tune.report(results, args.out)
        print(f"wrote {args.out}/summary.json, knob_heatmap.png, best_so_far.png")
        return 0
    from .schedules.database import DEFAULT_DATABASE, DatabaseError

    try:
        database = tune.record(results, args.db or DEFAULT_DATABASE)
    except DatabaseError as error:
        print(f"error: --db: {error}", file=sys.stderr)
        return 2
    print(f"{args.db or DEFAULT_DATABASE}: {len(database.records)} records")
    return 0


def _read_results(path: Path):
    """The results JSON at ``path``; otherwise one line and exit 2, as every refused argument."""
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        reason = f"results {path} cannot be read: {error}"
    else:
        if isinstance(results, dict) and "candidates" in results and "target" in results:
            return results
        reason = f"{path} is not a `tune measure` results file (it needs 'target' and 'candidates')"
    print(f"error: {reason}", file=sys.stderr)
    raise SystemExit(2)


def _self_check(args) -> int:
    from .selfcheck import run_cpu_self_check, self_check_specs

    try:
        list(self_check_specs(args.hidden))
    except ValueError as error:
        print(f"error: --hidden: {error}", file=sys.stderr)
        return 2
    return 0 if run_cpu_self_check(args.hidden) else 1


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from .loader import BundleError

    try:
        return {"build": _build, "list": _list, "inspect": _inspect, "bench": _bench, "tune": _tune, "self-check": _self_check}[args.command](args)
    except BundleError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
