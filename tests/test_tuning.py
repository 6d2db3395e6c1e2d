"""Schedule tuning: the knob space, search strategies, the tuning database and its use by
the build, per-M-bucket dispatch, and the report. CPU only; the GPU half is
``tune measure`` (docs/tuning.md)."""

import dataclasses
import functools
import importlib.util
import json
import math

import pytest
from conftest import require_toolchain

from tvm_rmsquant.schedules import RULES, default_schedule, rule_by_name
from tvm_rmsquant.schedules.database import DEFAULT_DATABASE, ROW_BUCKETS, DatabaseError, Record, TuningDatabase, bucket_of, build_target
from tvm_rmsquant.schedules.search import evaluate, knob_key, neighbours, propose_evolve, run_search
from tvm_rmsquant.spec import VariantSpec
from tvm_rmsquant.target import DEFAULT_ARCHS, scheduling_target
from tvm_rmsquant import tune

SPEC = VariantSpec("bf16", 4096, 128, True, "col", "fp32")
TARGET = {"gpu": "NVIDIA H200", "compute_capability": "9.0", "driver": "580.159.04", "cuda": "13.0", "tvm": "0.27.0.post1", "tvm_ffi": "0.1.14.post1"}
BUILD = {**{key: TARGET[key] for key in ("compute_capability", "tvm", "tvm_ffi", "cuda")}, "gpu": None}
DYNAMIC = VariantSpec("bf16", None, 128)
#: What the default build schedules for (TARGET is where a measurement ran).
SCHEDULING = scheduling_target(DEFAULT_ARCHS)


def test_every_rule_declares_an_enumerable_space_with_an_occupancy_knob():
    for rule in RULES:
        for spec in (SPEC, VariantSpec("bf16", None, 128)):
            if rule.default(spec, SCHEDULING) is None:
                continue
            space = rule.space(spec, SCHEDULING)
            assert "min_blocks_per_sm" in space and "vector" in space
            candidates = list(rule.candidates(spec, SCHEDULING))
            assert len(candidates) == len({knob_key(c) for c in candidates}) > 10
            assert rule.default(spec, SCHEDULING) in candidates
    refused = rule_by_name("row_resident").check(SPEC, {"vector": 4, "groups_per_thread": 1, "min_blocks_per_sm": 4}, SCHEDULING)
    assert "exceed the 2048 threads of an sm_90a SM" in refused


def test_the_occupancy_knob_becomes_a_launch_bounds_hint():
    """TVM's own attribute, around the kernel body, gives __launch_bounds__(threads, N), for
    both rules; 0 leaves the function as it was (and no knob changes the kernel digest)."""
    require_toolchain(nvcc=False)
    import re

    from tvm_rmsquant.codegen import lower

    dynamic = VariantSpec("bf16", None, 128, True, "col", "ue8m0_packed")
    for spec, rule, knobs in ((SPEC, "row_resident", {"vector": 8, "groups_per_thread": 4}),
                              (dynamic, "dynamic_rows", {"vector": 8, "rows_per_block": 4})):
        plain = lower._scheduled(spec, rule, {**knobs, "min_blocks_per_sm": 0}, SCHEDULING)
        assert lower.with_min_blocks_per_sm(plain, 0).same_as(plain)
        hinted = lower.with_min_blocks_per_sm(plain, 8)
        assert lower.MIN_BLOCKS_ATTR in hinted.script() and lower.MIN_BLOCKS_ATTR not in plain.script()
        source = lower.cuda_source([(spec, rule, {**knobs, "min_blocks_per_sm": 8}, "k", None)], DEFAULT_ARCHS)
        assert re.findall(r"__launch_bounds__\((\d+, \d+)\) k_grouped_kernel\(", source)[-1].endswith(", 8")


def _synthetic_costs(spec):
    """Smooth costs over the real space, one per M bucket: best at vector 8, 4 blocks/SM, and
    1, 2, 2 and 4 groups per thread from the smallest M bucket to the largest."""
    rule = rule_by_name(default_schedule(spec, SCHEDULING)[0])
    best_per_bucket = (1, 2, 2, 4)
    assert len(best_per_bucket) == len(ROW_BUCKETS)

    def cost(k, best_groups):
        return 10 * (1 + 0.2 * abs(math.log2(k["groups_per_thread"] / best_groups)) + 0.1 * (k["vector"] != 8) + 0.03 * abs(k["min_blocks_per_sm"] - 4) / 4)

    return rule, {knob_key(k): tuple(cost(k, groups) for groups in best_per_bucket) for k in rule.candidates(spec, SCHEDULING)}


def test_search_strategies_propose_distinct_valid_knobs_within_the_budget():
    rule, costs = _synthetic_costs(SPEC)
    for strategy in ("random", "evolve"):
        history = run_search(strategy, rule, SPEC, SCHEDULING, lambda k: costs[knob_key(k)], 9, seed=3)
        assert len(history) == 9 and len({knob_key(k) for k, _ in history}) == 9
        assert all(rule.check(SPEC, k, SCHEDULING) is None for k, _ in history)
    start = rule.default(SPEC, SCHEDULING)
    assert all(sum(start[name] != k[name] for name in start) == 1 for k in neighbours(rule, SPEC, SCHEDULING, start))
    # evolve starts from the hand-picked knobs, then proposes only untried ones
    first = propose_evolve(rule, SPEC, SCHEDULING, [], 2)
    assert first[0] == start and len(first) == 2
    later = propose_evolve(rule, SPEC, SCHEDULING, [(k, costs[knob_key(k)]) for k in first], 4)
    assert not {knob_key(k) for k in later} & {knob_key(k) for k in first}


def test_evaluate_replays_strategies_against_an_exhaustive_table():
    rule, costs = _synthetic_costs(SPEC)
    budget = len(costs) // 4
    result = evaluate(rule, SPEC, SCHEDULING, costs, budget, seeds=20)
    for strategy in ("random", "evolve"):
        assert len(result[strategy]) == len(ROW_BUCKETS)
        for bucket in result[strategy]:
            curve = bucket["median_curve"]
            assert len(curve) == budget and curve == sorted(curve, reverse=True) and curve[-1] >= 1.0
            assert 0 <= bucket["within_tolerance"] <= 1
    # on a smooth landscape the neighbour search beats uniform sampling in every bucket
    assert all(e["median_gap"] <= r["median_gap"] for e, r in zip(result["evolve"], result["random"]))


def test_replayed_strategies_start_from_the_same_hand_picked_schedule():
    """As every candidate bundle does: a head start for one strategy would be measured as its merit."""
    rule, costs = _synthetic_costs(SPEC)
    for seed in range(5):
        firsts = [run_search(strategy, rule, SPEC, SCHEDULING, lambda k: costs[knob_key(k)], 9, seed)[0][0] for strategy in ("random", "evolve")]
        assert firsts == [rule.default(SPEC, SCHEDULING)] * 2


def test_buckets_cover_every_m():
    assert [bucket_of(m) for m in (1, 64, 65, 256, 257, 1024, 1025, 10**6)] == [64, 64, 256, 256, 1024, 1024, None, None]
    assert ROW_BUCKETS[-1][0] is None


def _record(max_rows, knobs, target=TARGET, spec=SPEC.name, digest="d" * 16):
    return Record(spec, max_rows, "row_resident", knobs, 10.0, 11.0, dict(target), digest)


def test_the_database_uses_matching_records_and_rejects_the_rest_with_a_reason(tmp_path):
    small = {"vector": 4, "groups_per_thread": 2, "min_blocks_per_sm": 0}
    database = TuningDatabase([
        _record(64, small),
        _record(None, {"vector": 8, "groups_per_thread": 2, "min_blocks_per_sm": 4}, {**TARGET, "tvm": "0.26.0"}),
        _record(1024, {"vector": 8, "groups_per_thread": 16, "min_blocks_per_sm": 0}),
    ])
    tuned, rejected = database.for_build(BUILD)
    assert list(tuned.records) == [(SPEC.name, 64)]
    assert any("tvm='0.26.0', the build has '0.27.0.post1'" in line for line in rejected)
    assert any("cannot schedule" in line and "128 resident values per thread would spill" in line for line in rejected)
    assert database.for_build(BUILD, {"bf16_k7168_g128_row_fp32"})[1] == []  # only the specs being built are considered
    _, on_other_gpu = database.for_build({**BUILD, "gpu": "NVIDIA H100"})
    assert len(on_other_gpu) == 3 and "gpu='NVIDIA H200'" in on_other_gpu[0]

    fallback = default_schedule(SPEC, SCHEDULING)
    # buckets without a record take the hand-picked schedule; neighbours with one schedule merge
    assert tuned(SPEC, fallback) == [(64, "row_resident", small), (None, *fallback)]
    assert tuned(VariantSpec("bf16", 7168), default_schedule(VariantSpec("bf16", 7168), SCHEDULING)) == [(None, *default_schedule(VariantSpec("bf16", 7168), SCHEDULING))]

    path = tmp_path / "db.json"
    database.save(path)
    assert TuningDatabase.load(path).records == sorted(database.records, key=lambda r: math.inf if r.max_rows is None else r.max_rows)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(DatabaseError, match="bad.json is not valid JSON"):
        TuningDatabase.load(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text(json.dumps({"schema_version": 1, "records": []}))
    with pytest.raises(DatabaseError, match="schema_version=1, expected 2"):
        TuningDatabase.load(tmp_path / "old.json")


def test_the_database_refuses_ambiguous_picks_and_unknown_buckets_with_the_reason():
    knobs = {"vector": 4, "groups_per_thread": 2, "min_blocks_per_sm": 0}
    h100 = {**TARGET, "gpu": "NVIDIA H100"}
    two_gpus = TuningDatabase([_record(64, knobs), _record(64, {**knobs, "groups_per_thread": 1}, h100)])
    tuned, rejected = two_gpus.for_build(BUILD)
    assert tuned.records == {} and len(rejected) == 2
    assert all("2 records for this spec and M bucket match this build (NVIDIA H200, NVIDIA H100), so none is used: "
               "pass --tuning-gpu NAME" in line for line in rejected)
    # naming the GPU picks its record
    tuned, rejected = two_gpus.for_build({**BUILD, "gpu": "NVIDIA H100"})
    assert tuned.records[SPEC.name, 64].target["gpu"] == "NVIDIA H100" and "gpu='NVIDIA H200'" in rejected[0]
    # two records of one GPU for one bucket: naming the GPU cannot choose
    tuned, rejected = TuningDatabase([_record(64, knobs), _record(64, {**knobs, "groups_per_thread": 1})]).for_build({**BUILD, "gpu": "NVIDIA H200"})
    assert tuned.records == {} and len(rejected) == 2 and "keep one record per (spec, M bucket, GPU)" in rejected[0]
    # a bucket this code does not have is rejected, not listed as used
    tuned, rejected = TuningDatabase([_record(7, knobs), _record(64, knobs)]).for_build(BUILD)
    assert list(tuned.records) == [(SPEC.name, 64)]
    assert rejected == [f"{SPEC.name} M<=7 on NVIDIA H200: max_rows=7 is not an M bucket of this code (ROW_BUCKETS: [64, 256, 1024, None]); re-tune it"]


@pytest.mark.parametrize("vector", [0, -8, "8"])
def test_knob_values_outside_the_rules_space_are_refused_with_the_reason(vector):
    for spec in (SPEC, DYNAMIC):
        name, knobs = default_schedule(spec, SCHEDULING)
        assert rule_by_name(name).check(spec, {**knobs, "vector": vector}, SCHEDULING) == f"vector={vector!r} is not one of its values [2, 4, 8]"
    record = _record(64, {"vector": vector, "groups_per_thread": 2, "min_blocks_per_sm": 0})
    tuned, rejected = TuningDatabase([record]).for_build(BUILD, kernel_digest=lambda spec, rule, knobs: record.kernel_digest)
    assert tuned.records == {} and f"vector={vector!r} is not one of its values [2, 4, 8]" in rejected[0]


def test_malformed_records_and_folders_fail_the_load_naming_the_field(tmp_path):
    good = dataclasses.asdict(_record(64, {"vector": 8, "groups_per_thread": 2, "min_blocks_per_sm": 0}))
    path = tmp_path / "db.json"
    for change, says in [({"knobs": {**good["knobs"], "vector": "8"}}, "has knobs={.*'vector': '8'.*} \\(needs an object of integers\\)"),
                         ({"target": None}, "has target=None \\(needs an object of strings\\)"),
                         ({"max_rows": "64"}, "has max_rows='64' \\(needs an integer or null\\)")]:
        path.write_text(json.dumps({"schema_version": 2, "records": [good, {**good, **change}]}))
        with pytest.raises(DatabaseError, match=f"db.json: record 1 .*{says}"):
            TuningDatabase.load(path)
    with pytest.raises(DatabaseError, match=f"tuning database {tmp_path} is a folder; pass a file such as"):
        TuningDatabase.load(tmp_path)


def test_a_record_measured_on_another_kernel_is_rejected():
    """The tensor expression or the rule changed since the measurement: same knobs, another kernel."""
    record = _record(64, {"vector": 4, "groups_per_thread": 2, "min_blocks_per_sm": 0}, digest="0123456789abcdef")
    assert record.mismatch(BUILD, lambda spec, rule, knobs: "0123456789abcdef") is None
    tuned, rejected = TuningDatabase([record]).for_build(BUILD, kernel_digest=lambda spec, rule, knobs: "fedcba9876543210")
    assert tuned.records == {}
    assert "measured on another kernel (digest 0123456789abcdef; this code makes fedcba9876543210)" in rejected[0]


def test_the_build_target_names_the_toolchain_that_generates_the_code():
    toolchain = {"apache-tvm": "0.27.0.post1", "apache-tvm-ffi": "0.1.14.post1", "nvcc": "Build cuda_13.0.r13.0/compiler.36424714_0"}
    assert build_target(toolchain, (9, 0)) == BUILD


def _digest_for_target(kernel_digest, spec, rule, knobs):
    """The database's kernel digest (spec, rule, knobs) for the default build's scheduling target."""
    return kernel_digest(spec, rule, knobs, SCHEDULING)


def test_the_shipped_database_is_valid_and_matches_this_toolchain_and_code():
    database = TuningDatabase.load(DEFAULT_DATABASE)
    assert database.records
    digest = None  # without TVM the kernels cannot be made, so their digests go unchecked
    if importlib.util.find_spec("tvm") is not None:
        from tvm_rmsquant.codegen.lower import kernel_digest

        digest = functools.partial(_digest_for_target, kernel_digest)
    for record in database.records:
        assert set(record.target) >= {"gpu", "compute_capability", "driver", "cuda", "tvm", "tvm_ffi"}
        assert record.microseconds <= record.default_microseconds * 1.0001, record  # never slower than hand-picked
        assert record.mismatch(BUILD, digest) is None, record


def test_the_plan_gives_each_tuned_bucket_its_own_kernel():
    from tvm_rmsquant.codegen.bundle import plan

    small = {"vector": 4, "groups_per_thread": 2, "min_blocks_per_sm": 0}
    tuned, _ = TuningDatabase([_record(64, small)]).for_build(BUILD)
    (variants,) = plan([SPEC], tuned=tuned).values()
    assert [(v.symbol, v.max_rows, dict(v.knobs)) for v in variants] == [
        (f"{SPEC.name}__m64", 64, small),
        (SPEC.name, None, default_schedule(SPEC, SCHEDULING)[1]),
    ]


def _results(times_by_knobs):
    """A ``tune measure`` results file, for report and record."""
    default = default_schedule(SPEC, SCHEDULING)[1]
    candidates = []
    for index, (knobs, scale) in enumerate(times_by_knobs):
        times = {str(m): scale * (1 + m / 1024) for m in tune.MEASURED_ROWS}
        candidates.append({"symbol": f"{SPEC.name}__t{index:03d}", "spec": SPEC.name, "rule": "row_resident", "knobs": knobs,
                           "is_default": knobs == default, "kernel_digest": f"{index:016x}", "ptxas": {}, "microseconds": times, "dropped": None})
    return {"target": TARGET, "ceiling_gbps": 4200.0, "rows": list(tune.MEASURED_ROWS), "candidates": candidates}


def test_record_keeps_the_fastest_per_bucket_and_never_one_slower_than_hand_picked(tmp_path):
    default = default_schedule(SPEC, SCHEDULING)[1]
    faster = {"vector": 4, "groups_per_thread": 2, "min_blocks_per_sm": 0}
    wrong = {"vector": 8, "groups_per_thread": 8, "min_blocks_per_sm": 0}
    marginal = {"vector": 8, "groups_per_thread": 2, "min_blocks_per_sm": 0}
    results = _results([(default, 1.0), (faster, 0.9), (wrong, 0.5)])
    # a gain below tune.MIN_GAIN is not evidence: the hand-picked schedule stays
    assert all(r.knobs == default for r in tune.best_records(_results([(default, 1.0), (marginal, 0.97)])))
    results["candidates"][2]["dropped"] = "M=1: WRONG: codes identical 0.5"
    records = tune.best_records(results)
    assert [(r.max_rows, r.knobs, r.kernel_digest) for r in records] == [(max_rows, faster, f"{1:016x}") for max_rows, _ in ROW_BUCKETS]
    assert all(r.microseconds < r.default_microseconds for r in records)
    path = tmp_path / "db.json"
    database = tune.record(results, path)
    assert len(TuningDatabase.load(path).records) == len(database.records) == len(ROW_BUCKETS)
    # a later measurement of the same (spec, bucket, GPU) replaces the record
    assert len(tune.record(_results([(default, 1.0)]), path).records) == len(ROW_BUCKETS)
    assert all(r.knobs == default for r in TuningDatabase.load(path).records)


def test_report_ranks_plots_and_evaluates_the_search_on_an_exhaustive_run(tmp_path):
    rule, costs = _synthetic_costs(SPEC)
    results = _results([(dict(key), cost[0] / 10) for key, cost in costs.items()])
    lines = []
    summary = tune.report(results, tmp_path, log=lines.append)
    assert (tmp_path / "knob_heatmap.png").stat().st_size > 0 and (tmp_path / "best_so_far.png").stat().st_size > 0
    assert len(summary["search"]) == len(ROW_BUCKETS) and all(row["budget"] == len(costs) // 4 for row in summary["search"])
    assert any(line.startswith(f"{SPEC.name:34s} M<=64") for line in lines)
    best = min(costs, key=lambda key: costs[key][0])
    assert all(knob_key(r["knobs"]) == best for r in summary["records"])  # 40% faster than hand-picked


def test_timing_noise_is_the_spread_of_one_kernel_timed_as_two():
    default = default_schedule(SPEC, SCHEDULING)[1]
    results = _results([(default, 1.0), ({**default, "min_blocks_per_sm": 2}, 1.04), ({**default, "groups_per_thread": 2}, 0.5)])
    noise = tune.timing_noise(results)
    assert [(row["max_rows"], row["groups"], row["above_min_gain"]) for row in noise] == [(max_rows, 1, 0) for max_rows, _ in ROW_BUCKETS]
    assert all(row["worst"] == pytest.approx(0.04) and row["worst_spec"] == SPEC.name for row in noise)
    results["candidates"][1]["ptxas"] = {"registers": 40}  # ptxas used the hint: another kernel, not noise
    assert tune.timing_noise(results) == []


@pytest.mark.parametrize("knobs, says", [
    ("vector=0", "vector=0 is no schedule rule's value; vector takes [2, 4, 8]"),
    ("vector=-8", "vector=-8 is no schedule rule's value; vector takes [2, 4, 8]"),
    ("vectr=4", "vectr is no schedule rule's knob; the knobs are ['groups_per_thread', 'min_blocks_per_sm', 'rows_per_block', 'vector']"),
])
def test_build_refuses_knobs_no_rule_has_in_one_line(tmp_path, capsys, knobs, says):
    from tvm_rmsquant.cli import main

    # -j 0 would stop a build that got past the knobs before it builds anything
    assert main(["build", "--knobs", knobs, "-j", "0", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: --knobs={knobs!r}: {says}"]
    # valid for one rule (rows_per_block: dynamic_rows), not another: applied where valid
    from tvm_rmsquant.cli import _parse_knobs

    assert _parse_knobs("rows_per_block=4,groups_per_thread=2") == {"rows_per_block": 4, "groups_per_thread": 2}


def test_tune_record_refuses_a_folder_database_in_one_line(tmp_path, capsys):
    from tvm_rmsquant.cli import main

    (tmp_path / "r.json").write_text(json.dumps(_results([(default_schedule(SPEC, SCHEDULING)[1], 1.0)])))
    assert main(["tune", "record", str(tmp_path / "r.json"), "--db", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: --db: tuning database {tmp_path} is a folder; pass a file such as {tmp_path / 'tuning_db.json'}"]


def test_tune_cli_refuses_what_it_cannot_do(tmp_path, capsys):
    from tvm_rmsquant.cli import main

    assert main(["tune", "build", "--strategy", "evolve", "--out", str(tmp_path / "c")]) == 2
    assert "--strategy=evolve proposes from measured results" in capsys.readouterr().err
    assert main(["tune", "build", "--trials", "0", "--out", str(tmp_path / "c")]) == 2
    (tmp_path / "r.json").write_text("{}")
    with pytest.raises(SystemExit) as exit:
        main(["tune", "report", str(tmp_path / "r.json")])
    assert exit.value.code == 2 and "is not a `tune measure` results file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "build", "--spec", "bf16_k4096_nonsense", "--out", str(tmp_path / "c")])
    assert not (tmp_path / "c").exists()


def test_candidate_knobs_always_include_the_hand_picked_schedule_first():
    default = default_schedule(SPEC, SCHEDULING)
    for strategy in ("exhaustive", "random"):
        chosen = tune.candidate_knobs(SPEC, SCHEDULING, strategy, 4, seed=1)
        assert chosen[0] == default and len({knob_key(k) for _, k in chosen}) == len(chosen)
    assert len(tune.candidate_knobs(SPEC, SCHEDULING, "exhaustive", 1)) == len(list(rule_by_name(default[0]).candidates(SPEC, SCHEDULING)))
    with pytest.raises(ValueError, match="strategy='grid' is unknown"):
        tune.candidate_knobs(SPEC, SCHEDULING, "grid", 4)


def test_recorded_strategy_rebuilds_the_database_picks_beside_the_hand_picked_schedule():
    database = TuningDatabase.load(DEFAULT_DATABASE)
    for spec in tune.TUNE_SPECS:
        chosen = tune.candidate_knobs(spec, SCHEDULING, "recorded", 1)
        assert chosen[0] == default_schedule(spec, SCHEDULING)
        recorded = {knob_key(r.knobs) for r in database.records if r.spec == spec.name}
        assert {knob_key(k) for _, k in chosen} == recorded | {knob_key(default_schedule(spec, SCHEDULING)[1])}


@pytest.fixture(scope="module")
def toolchain():
    require_toolchain()


def test_a_tuned_build_ships_one_kernel_per_bucket_with_its_knobs(tmp_path, toolchain):
    from tvm_rmsquant.codegen import bundle as builder
    from tvm_rmsquant.loader import Bundle

    small = {"vector": 4, "groups_per_thread": 2, "min_blocks_per_sm": 4}
    tuned, _ = TuningDatabase([_record(64, small)]).for_build(BUILD)
    report = builder.build([SPEC], tmp_path / "bundle", jobs=1, cache_dir=tmp_path / "cache", tuned=tuned)
    assert (report.variants, report.kernels) == (1, 2) and "built 1 variant (2 kernels) in 1 library:" in report.summary()
    bundle = Bundle(tmp_path / "bundle")
    entry = bundle.entry(SPEC.name)
    assert entry["knobs"] == default_schedule(SPEC, SCHEDULING)[1] and "max_rows" not in entry
    (bucket,) = entry["by_rows"]
    assert bucket["max_rows"] == 64 and bucket["knobs"] == small and bucket["symbol"] == f"{SPEC.name}__m64"
    source = (bundle.path / bundle.manifest["libraries"][entry["library"]]["source"]).read_text()
    assert f"__launch_bounds__(512, 4) {bucket['kernel']}(" in source and f"__tvm_ffi_{bucket['symbol']}(" in source
    # The variant's entry points pick the bucket's kernel for M <= 64 in C++, else their own.
    table = f"{SPEC.name}_kernels[] = {{{{64, __tvm_ffi_{bucket['symbol']}_grouped}}, {{-1, __tvm_ffi_{SPEC.name}_grouped}}}};"
    own = f"{bucket['symbol']}_kernels[] = {{{{-1, __tvm_ffi_{bucket['symbol']}_grouped}}}};"  # the bucket's entry, for tuning
    assert table in source and own in source


def test_a_candidate_bundle_lists_candidates_for_measurement_only(tmp_path, toolchain):
    from tvm_rmsquant.codegen import bundle as builder
    from tvm_rmsquant.codegen.lower import kernel_digest
    from tvm_rmsquant.loader import Bundle

    report = tune.build_candidates([SPEC], "random", 2, tmp_path / "candidates", jobs=1, seed=5, cache_dir=tmp_path / "cache")
    bundle = Bundle(tmp_path / "candidates")
    assert bundle.names() == [] and report.variants == 1 and report.kernels == len(bundle.candidates()) == 3
    assert bundle.manifest["tuning"] == {"strategy": "random", "trials": 2, "seed": 5}
    first = bundle.candidates()[f"{SPEC.name}__t000"]
    assert first["knobs"] == default_schedule(SPEC, SCHEDULING)[1] and first["ptxas"]["sm_90a"]["registers"] > 0
    # what a record of this candidate will carry, and what a build recomputes to accept it
    assert first["kernel_digest"] == kernel_digest(SPEC, "row_resident", first["knobs"], SCHEDULING)
    assert set(builder.plan_candidates({SPEC: [("row_resident", default_schedule(SPEC, SCHEDULING)[1])] * 9})) == {f"cand_{SPEC.name}_0", f"cand_{SPEC.name}_1"}
    # measure refuses a spec the bundle has no candidates for before it touches a GPU
    with pytest.raises(ValueError, match=r"--spec \['bf16_k7168_g128_row_fp32'\] has no candidates"):
        tune.measure_candidates(bundle, specs=[VariantSpec("bf16", 7168)])


def test_the_build_refuses_an_unreadable_tuning_database_before_building(tmp_path, capsys, toolchain):
    from tvm_rmsquant.cli import main

    (tmp_path / "db.json").write_text("not json")
    assert main(["build", "--hidden", "4096", "--dtype", "bf16", "--tuning-db", str(tmp_path / "db.json"), "--out", str(tmp_path / "out")]) == 2
    assert "db.json is not valid JSON" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_the_build_refuses_a_folder_or_malformed_tuning_database_in_one_line(tmp_path, capsys, toolchain):
    from tvm_rmsquant.cli import main

    null_target = {**dataclasses.asdict(_record(64, {"vector": 8, "groups_per_thread": 2, "min_blocks_per_sm": 0})), "target": None}
    (tmp_path / "null.json").write_text(json.dumps({"schema_version": 2, "records": [null_target]}))
    for database, says in [(tmp_path, "is a folder"), (tmp_path / "null.json", "has target=None (needs an object of strings)")]:
        assert main(["build", "--hidden", "4096", "--dtype", "bf16", "--tuning-db", str(database), "--out", str(tmp_path / "out")]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"error: tuning database {database}") and says in line
    assert not (tmp_path / "out").exists()


def test_the_build_remembers_kernel_digests_per_code_and_toolchain(tmp_path, toolchain, monkeypatch):
    """The remembered digest is the computed one; a second build with the same code and
    toolchain schedules nothing; a damaged file is recomputed; another toolchain is another key."""
    from tvm_rmsquant.codegen import bundle as builder, lower

    spec = VariantSpec.parse("bf16_k4096_g128_col_fp32")
    rule, knobs = default_schedule(spec, SCHEDULING)
    tools = {"apache-tvm": "x", "nvcc": "y", "target_archs": list(DEFAULT_ARCHS)}
    want = lower.kernel_digest(spec, rule, knobs, SCHEDULING)
    assert builder.KernelDigests(tmp_path, tools)(spec, rule, knobs) == want
    (stored,) = (tmp_path / "digests").iterdir()
    with monkeypatch.context() as patch:
        patch.setattr(lower, "kernel_digest", lambda *args: pytest.fail("scheduled again"))
        assert builder.KernelDigests(tmp_path, tools)(spec, rule, knobs) == want
    stored.write_text('{"truncated')
    assert builder.KernelDigests(tmp_path, tools)(spec, rule, knobs) == want
    assert json.loads(stored.read_text()) == {f"{spec.name}|{rule}|{json.dumps(knobs, sort_keys=True)}": want}
    builder.KernelDigests(tmp_path, {**tools, "nvcc": "z"})(spec, rule, knobs)
    assert len(list((tmp_path / "digests").iterdir())) == 2
