"""Schedule tuning, split like TVM's builder and runner (the GPU machine has no compiler).

    build     (CPU, needs TVM)     candidate knobs per spec -> a candidate bundle
    measure   (GPU, torch+tvm-ffi) check each candidate against the reference, drop and
                                   report failures, time the rest over an M sweep -> results JSON
    report    (anywhere)           ranking, knob heat-map, best-so-far against trials
    record    (anywhere)           the best schedule per (spec, M bucket) -> the tuning database

Every candidate bundle also holds each spec's hand-picked schedule, so that results
always compare against it within one run.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .schedules import default_schedule, rule_by_name
from .schedules.database import DEFAULT_DATABASE, ROW_BUCKETS, Record, TuningDatabase, bucket_score, cuda_release
from .schedules.search import evaluate, knob_key, propose_evolve
from .spec import VariantSpec
from .target import DEFAULT_ARCHS, TARGETS, Target, for_capability, scheduling_target

#: The specs the tuning bar names: bf16, K in {4096, 7168}, with and without residual,
#: for the layouts/formats of DeepGEMM/cuBLAS (col fp32), Triton (row fp32) and UE8M0.
TUNE_SPECS = tuple(
    VariantSpec("bf16", hidden, 128, residual, layout, fmt)
    for hidden in (4096, 7168)
    for residual in (False, True)
    for layout, fmt in (("row", "fp32"), ("col", "fp32"), ("col", "ue8m0"))
)
#: M values timed by ``measure``: every bucket's timed values.
MEASURED_ROWS = tuple(sorted({rows for _, timed in ROW_BUCKETS for rows in timed}))
#: ``recorded`` rebuilds the tuning database's picks beside the hand-picked schedules, so that a
#: later run can confirm them against each other.
STRATEGIES = ("exhaustive", "random", "evolve", "recorded")


# -- build (CPU) ------------------------------------------------------------------------------


def candidate_knobs(spec: VariantSpec, target: Target, strategy: str, trials: int, seed: int = 0,
                    measured: Sequence[Tuple[Dict, float]] = ()) -> List[Tuple[str, Dict]]:
    """(rule, knobs) to build for ``spec`` on ``target``: the hand-picked schedule first, then the strategy's."""
    rule_name, default = default_schedule(spec, target)
    rule = rule_by_name(rule_name)
    if strategy == "exhaustive":
        chosen = list(rule.candidates(spec, target))
    elif strategy == "random":
        chosen = rule.sample(spec, target, trials, seed)
    elif strategy == "evolve":
        chosen = propose_evolve(rule, spec, target, measured, trials, seed)
    elif strategy == "recorded":
        chosen = [record.knobs for record in TuningDatabase.load(DEFAULT_DATABASE).records if record.spec == spec.name and record.rule == rule_name]
    else:
        raise ValueError(f"strategy={strategy!r} is unknown; choose one of {STRATEGIES}")
    unique = {knob_key(default): default}
    for knobs in chosen:
        unique.setdefault(knob_key(knobs), knobs)
    return [(rule_name, knobs) for knobs in unique.values()]


def build_candidates(specs: Sequence[VariantSpec], strategy: str, trials: int, out: Path, jobs: int = 2, seed: int = 0,
                     previous: Optional[Dict] = None, cache_dir: Optional[Path] = None, progress=None, log=print):
    """Build a candidate bundle at ``out`` for the default archs; ``previous`` results seed the
    ``evolve`` strategy."""
    from .codegen import bundle as builder

    target = scheduling_target(DEFAULT_ARCHS)
    candidates = {}
    for spec in specs:
        measured = _measured_trials(previous, spec) if previous else []
        candidates[spec] = candidate_knobs(spec, target, strategy, trials, seed, measured)
        if strategy == "evolve" and len(candidates[spec]) - 1 < trials:
            log(f"{spec.name}: evolve proposed {len(candidates[spec]) - 1} of {trials} trials; the rest of its space is already measured")
    libraries = builder.plan_candidates(candidates)
    extra = {"tuning": {"strategy": strategy, "trials": trials, "seed": seed}}
    return builder.build_libraries(libraries, out, jobs, cache_dir, progress, extra, DEFAULT_ARCHS)


def _measured_trials(results: Dict, spec: VariantSpec) -> List[Tuple[Dict, Tuple[float, ...]]]:
    """(knobs, score per M bucket) of ``spec``'s measured candidates; failed ones cost infinity."""
    trials = []
    for candidate in results["candidates"]:
        if candidate["spec"] == spec.name:
            times = {int(rows): value for rows, value in candidate["microseconds"].items()}
            scores = [bucket_score(times, max_rows) if candidate["dropped"] is None else math.inf for max_rows, _ in ROW_BUCKETS]
            trials.append((candidate["knobs"], tuple(score if math.isfinite(score) else math.inf for score in scores)))
    return trials


# -- measure (GPU) ----------------------------------------------------------------------------


def gpu_target(bundle) -> Dict[str, str]:
    """Where a measurement ran, and the toolchain that built what it measured."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, check=True).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        driver = "unknown"
    toolchain = bundle.manifest["toolchain"]
    return {
        "gpu": torch.cuda.get_device_name(),
        "compute_capability": f"{major}.{minor}",
        "driver": driver,
        "cuda": cuda_release(toolchain["nvcc"]),
        "cuda_runtime": str(torch.version.cuda),
        "tvm": toolchain["apache-tvm"],
        "tvm_ffi": metadata.version("apache-tvm-ffi"),
    }


def measure_candidates(bundle, rows_list: Sequence[int] = MEASURED_ROWS, eps: float = 1e-6, log=print, out: Optional[Path] = None,
                       specs: Optional[Sequence[VariantSpec]] = None) -> Dict:
    """Check then time the candidates of a candidate bundle (those of ``specs``, if given) over
    ``rows_list``; the results so far are rewritten to ``out`` after each spec, so a run cut
    short keeps what it measured."""
    import torch

    from .timing import copy_ceiling, cpu_oracle, input_copies, kernel_call, op_bytes, point_inputs, time_call
    from .checks import compare

    candidates = bundle.candidates()
    if not candidates:
        raise ValueError(f"bundle {bundle.path} holds no tuning candidates; build one with `python -m tvm_rmsquant tune build`")
    by_spec: Dict[str, List[Tuple[str, Dict]]] = {}
    for symbol, entry in sorted(candidates.items()):
        by_spec.setdefault(VariantSpec.from_json(entry["spec"]).name, []).append((symbol, entry))
    if specs:
        missing = sorted({spec.name for spec in specs} - set(by_spec))
        if missing:
            raise ValueError(f"--spec {missing} has no candidates in {bundle.path}; it holds {sorted(by_spec)}")
        by_spec = {name: entries for name, entries in by_spec.items() if name in {spec.name for spec in specs}}
    bundle.check_device(torch.cuda.get_device_capability())
    target = scheduling_target(bundle.target_archs)
    results = {"target": gpu_target(bundle), "ceiling_gbps": copy_ceiling(), "rows": list(rows_list), "candidates": []}
    log(f"copy ceiling (read+write): {results['ceiling_gbps']:.0f} GB/s; {sum(map(len, by_spec.values()))} candidates of {len(by_spec)} specs")
    for spec_name, entries in by_spec.items():
        spec = VariantSpec.parse(spec_name)
        hidden = spec.hidden
        default = dict(default_schedule(spec, target)[1])
        rows_out = {symbol: {} for symbol, _ in entries}
        dropped: Dict[str, Optional[str]] = {symbol: None for symbol, _ in entries}
        functions = {symbol: bundle.kernel_function(entry) for symbol, entry in entries}
        for rows in rows_list:
            copies = input_copies(op_bytes(spec, rows, hidden))
            input_sets = [point_inputs(spec, rows, hidden, copy) for copy in range(copies)]
            want = cpu_oracle(spec, rows, hidden, eps)
            for symbol, _ in entries:
                if dropped[symbol] is not None:
                    continue
                function = functions[symbol]
                check, outputs = kernel_call(function, spec, input_sets[0], eps)
                check()
                agreement = compare(spec, outputs, want, hidden)
                if not agreement.passed:
                    dropped[symbol] = f"M={rows}: WRONG: {agreement.describe()}"
                    log(f"DROPPED {symbol}: {dropped[symbol]}")
                    continue
                rows_out[symbol][rows] = time_call(lambda index, function=function: kernel_call(function, spec, input_sets[index], eps)[0], copies, rows)
        for symbol, entry in entries:
            results["candidates"].append({
                "symbol": symbol,
                "spec": spec_name,
                "rule": entry["rule"],
                "knobs": entry["knobs"],
                "is_default": entry["knobs"] == default,
                "kernel_digest": entry["kernel_digest"],
                "ptxas": entry["ptxas"],
                "microseconds": {str(rows): value for rows, value in rows_out[symbol].items()} if dropped[symbol] is None else {},
                "dropped": dropped[symbol],
            })
            times = " ".join(f"{value:7.2f}" for value in rows_out[symbol].values())
            log(f"{symbol:40s} {json.dumps(entry['knobs'], sort_keys=True):62s} {times if dropped[symbol] is None else 'DROPPED'}")
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            staged = out.with_name(f".{out.name}.tmp")
            staged.write_text(json.dumps(results, indent=1))
            staged.replace(out)
    return results


# -- report and record (anywhere) -------------------------------------------------------------


#: A measured schedule replaces the hand-picked one only when it is at least this much
#: faster. The H200 run's own noise (``timing_noise``): kernels that differ only in a hint
#: ptxas did not need spread by at most 2.7% at M <= 64, where the adopted gains are 5.4-10.2%,
#: 2.9% at 64 < M <= 256 (gains 5.2-9.4%) and 2.2% above M = 1024; by up to 5.45% at
#: 256 < M <= 1024 (2 of 72 groups above 5%), where the best candidate gained 3.4%. A smaller
#: gain is not evidence.
MIN_GAIN = 0.05


def best_records(results: Dict) -> List[Record]:
    """Per (spec, M bucket), the fastest valid candidate if it beats the hand-picked one by
    ``MIN_GAIN``, else the hand-picked one; both times are recorded."""
    records = []
    for spec_name in dict.fromkeys(candidate["spec"] for candidate in results["candidates"]):
        mine = [c for c in results["candidates"] if c["spec"] == spec_name and c["dropped"] is None]
        default = next((c for c in mine if c["is_default"]), None)
        if default is None:
            raise ValueError(f"results hold no measured hand-picked schedule for {spec_name}; tune build always includes it")
        for max_rows, _ in ROW_BUCKETS:
            score = lambda c: bucket_score({int(k): v for k, v in c["microseconds"].items()}, max_rows)  # noqa: E731
            best = min(mine, key=lambda c: (score(c), not c["is_default"]))
            if score(default) < score(best) * (1 + MIN_GAIN):
                best = default
            records.append(Record(spec_name, max_rows, best["rule"], best["knobs"], score(best), score(default), dict(results["target"]), best["kernel_digest"]))
    return records


def timing_noise(results: Dict) -> List[Dict]:
    """Per M bucket, the spread (slowest / fastest - 1) of the bucket scores of candidates that
    differ only in a ``min_blocks_per_sm`` hint ptxas did not need (same spec and other knobs,
    same registers, shared memory and spills): one kernel timed as separate kernels of one
    run, so a gain below the worst spread may be noise (``MIN_GAIN``)."""
    groups: Dict[str, List[Dict]] = {}
    for c in results["candidates"]:
        if c["dropped"] is None:
            shape = {name: value for name, value in c["knobs"].items() if name != "min_blocks_per_sm"}
            groups.setdefault(json.dumps([c["spec"], shape, c["ptxas"]], sort_keys=True), []).append(c)
    noise = []
    for max_rows, _ in ROW_BUCKETS:
        spreads = []
        for members in (members for members in groups.values() if len(members) > 1):
            scores = [bucket_score({int(k): v for k, v in c["microseconds"].items()}, max_rows) for c in members]
            spreads.append((max(scores) / min(scores) - 1, members[0]["spec"]))
        if spreads:
            worst = max(spreads)
            noise.append({"max_rows": max_rows, "groups": len(spreads), "median": statistics.median(s for s, _ in spreads),
                          "worst": worst[0], "worst_spec": worst[1], "above_min_gain": sum(s > MIN_GAIN for s, _ in spreads)})
    return noise


def search_evaluation(results: Dict, budget_fraction: float = 0.25, seeds: int = 50) -> List[Dict]:
    """Each strategy replayed against the exhaustive measurement: per (spec, M bucket), how
    close ``budget_fraction`` of the trials (each timing one candidate at every M) gets."""
    major, minor = (int(part) for part in results["target"]["compute_capability"].split("."))
    target = for_capability((major, minor), tuple(TARGETS))
    rows = []
    for spec_name in dict.fromkeys(candidate["spec"] for candidate in results["candidates"]):
        spec = VariantSpec.parse(spec_name)
        rule_name, _ = default_schedule(spec, target)
        rule = rule_by_name(rule_name)
        space = len(list(rule.candidates(spec, target)))
        costs = {knob_key(knobs): scores for knobs, scores in _measured_trials(results, spec)}
        if len(costs) < space:
            raise ValueError(f"{spec_name}: {len(costs)} of {space} candidates measured; evaluating a search needs the exhaustive run")
        budget = max(1, int(space * budget_fraction))
        evaluation = evaluate(rule, spec, target, costs, budget, seeds)
        for index, (max_rows, _) in enumerate(ROW_BUCKETS):
            per_bucket = {strategy: evaluation[strategy][index] for strategy in evaluation}
            rows.append({"spec": spec_name, "max_rows": max_rows, "space": space, "budget": budget, **per_bucket})
    return rows


def report(results: Dict, out: Path, log=print) -> Dict:
    """Print the ranking per spec, write the heat-map and best-so-far plots and a summary JSON."""
    out.mkdir(parents=True, exist_ok=True)
    records = best_records(results)
    for record in records:
        gain = record.default_microseconds / record.microseconds - 1
        log(f"{record.spec:34s} M<={str(record.max_rows or 'any'):4s} chosen {json.dumps(record.knobs, sort_keys=True):62s} "
            f"{record.microseconds:8.2f} us, hand-picked {record.default_microseconds:8.2f} us ({100 * gain:+.1f}%)")
    dropped = [c for c in results["candidates"] if c["dropped"] is not None]
    for candidate in dropped:
        log(f"dropped {candidate['symbol']}: {candidate['dropped']}")
    summary = {"records": [r.__dict__ for r in records], "dropped": [c["symbol"] for c in dropped], "noise": timing_noise(results)}
    for row in summary["noise"]:
        log(f"noise M<={str(row['max_rows'] or 'any'):4s} {row['groups']} groups differing only in an unneeded min_blocks_per_sm hint: "
            f"spread median {100 * row['median']:.2f}%, worst {100 * row['worst']:.2f}% ({row['worst_spec']}), {row['above_min_gain']} above MIN_GAIN")
    try:
        summary["search"] = search_evaluation(results)
    except ValueError as error:
        log(f"search evaluation skipped: {error}")
    for row in summary.get("search", []):
        log(f"search {row['spec']:34s} M<={str(row['max_rows'] or 'any'):4s} budget {row['budget']}/{row['space']}: "
            + ", ".join(f"{name} within 3% in {100 * row[name]['within_tolerance']:.0f}% of runs (median gap {100 * row[name]['median_gap']:.1f}%)" for name in ("random", "evolve")))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    _plot_heatmaps(results, out / "knob_heatmap.png")
    if "search" in summary:
        _plot_search(summary["search"], out / "best_so_far.png")
    return summary


def _plot_heatmaps(results: Dict, path: Path) -> None:
    """Per spec (large-M bucket): time relative to the best, rows (vector, groups_per_thread), columns min_blocks_per_sm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = list(dict.fromkeys(c["spec"] for c in results["candidates"]))
    columns = 3
    figure, axes = plt.subplots(-(-len(specs) // columns), columns, figsize=(6 * columns, 4 * -(-len(specs) // columns)), squeeze=False)
    for axis, spec_name in zip(axes.flat, specs):
        mine = [c for c in results["candidates"] if c["spec"] == spec_name]
        shape_knobs = sorted({tuple((k, v) for k, v in sorted(c["knobs"].items()) if k != "min_blocks_per_sm") for c in mine})
        occupancy = sorted({c["knobs"].get("min_blocks_per_sm", 0) for c in mine})
        scores = {}
        for c in mine:
            score = bucket_score({int(k): v for k, v in c["microseconds"].items()}, None) if c["dropped"] is None else math.nan
            scores[(tuple((k, v) for k, v in sorted(c["knobs"].items()) if k != "min_blocks_per_sm"), c["knobs"].get("min_blocks_per_sm", 0))] = score
        best = min(v for v in scores.values() if v == v)
        grid = [[scores.get((shape, blocks), math.nan) / best for blocks in occupancy] for shape in shape_knobs]
        image = axis.imshow(grid, cmap="viridis_r", vmin=1.0, vmax=min(2.0, max(v for row in grid for v in row if v == v)), aspect="auto")
        axis.set_xticks(range(len(occupancy)), [str(b) for b in occupancy])
        axis.set_yticks(range(len(shape_knobs)), [" ".join(f"{k[:1]}{v}" for k, v in shape) for shape in shape_knobs], fontsize=7)
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                if value == value:
                    axis.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6, color="w")
        axis.set_xlabel("min_blocks_per_sm")
        axis.set_title(f"{spec_name}, M >= 4096: time / best", fontsize=8)
        figure.colorbar(image, ax=axis)
    for axis in list(axes.flat)[len(specs):]:
        axis.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def _plot_search(evaluations: List[Dict], path: Path) -> None:
    """Median best-so-far (relative to the exhaustive best) against trials, per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 6
    figure, axes = plt.subplots(-(-len(evaluations) // columns), columns, figsize=(3.2 * columns, 2.6 * -(-len(evaluations) // columns)), squeeze=False)
    for axis, row in zip(axes.flat, evaluations):
        for name in ("random", "evolve"):
            curve = row[name]["median_curve"]
            axis.plot(range(1, len(curve) + 1), curve, marker="o", markersize=3, label=name)
        axis.axhline(1.03, color="k", linestyle="--", linewidth=0.8, label="exhaustive best + 3%")
        axis.set_ylim(0.99, 1.3)
        axis.set_title(f"{row['spec']} M<={row['max_rows'] or 'any'}", fontsize=6)
        axis.set_xlabel(f"trials (of {row['space']})", fontsize=7)
    for axis in list(axes.flat)[len(evaluations):]:
        axis.axis("off")
    axes.flat[0].legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=80)


def record(results: Dict, database_path: Path) -> TuningDatabase:
    """Merge the results' best schedules into the database at ``database_path`` (created if absent)."""
    database = TuningDatabase.load(database_path) if Path(database_path).exists() else TuningDatabase([])
    merged = database.merged(best_records(results))
    merged.save(database_path)
    return merged
