"""The tuning database: the best measured schedule of a spec per M bucket, and where it ran.

Records come from ``python -m tvm_rmsquant tune measure`` on a GPU and are consumed by the
offline build. A record is used only where its target matches the build: the compute
capability of the bundle's machine code, and the apache-tvm, apache-tvm-ffi and CUDA
versions that generate and compile the kernel (and the GPU, when the build names one),
and the kernel itself: the record's kernel digest must equal the one this code makes for
its (spec, rule, knobs), as TVM's meta_schedule matches a record to its workload; its M
bucket must be one of ``ROW_BUCKETS``, and no other record may match the same (spec, bucket).
Anything else is rejected with the reason, never silently used; a record whose fields have
the wrong types fails the load (``DatabaseError``). The driver is recorded but not matched:
it does not change the generated code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tvm_rmsquant.spec import VariantSpec
from tvm_rmsquant.target import TARGETS, for_capability

from . import rule_by_name
from .base import Knobs

SCHEMA_VERSION = 2
#: The database committed with the package; the build reads it unless told otherwise.
DEFAULT_DATABASE = Path(__file__).with_name("tuning_db.json")
#: M buckets as (max_rows, the M values timed for it); the last takes every larger M. A bucket
#: is timed at the ends of its range (the first also at 16). 64 < M <= 256 (up to two rows per
#: SM on 132 SMs) has its own kernel because one kernel for 64 < M <= 1024, scored on M = 256
#: and 1024 together, took the large-M schedule (4 groups per thread) where the M = 256 time
#: wanted 2: in the committed runs (docs/tuning/) a schedule beats the hand-picked one on (64,
#: 256) by 5.2-9.4 % in 9 of 12 specs on the H200 and by 5.8-10.6 % at K = 2048, 4096 and 5120
#: on the H100, above those runs' noise in this bucket (worst 2.9 % and 1.2 %,
#: ``tune.timing_noise``). At K = 4096, M = 256 on the H100 (2026-12-06, two runs) FlashInfer's
#: fused kernel took 4.84 us, between the two schedules: 4.43 (2 groups per thread) and 4.91
#: (4).
ROW_BUCKETS: Tuple[Tuple[Optional[int], Tuple[int, ...]], ...] = (
    (64, (1, 16, 64)), (256, (64, 256)), (1024, (256, 1024)), (None, (4096, 16384)))
#: Target fields that must equal the build's for a record to be used.
MATCHED_FIELDS = ("compute_capability", "tvm", "tvm_ffi", "cuda")


def cuda_release(nvcc_version: str) -> str:
    """'13.0' from nvcc's 'Build cuda_13.0.r13.0/compiler...' line."""
    found = re.search(r"cuda_(\d+\.\d+)", nvcc_version)
    return found.group(1) if found else nvcc_version


def build_target(toolchain: Dict[str, str], capability: Tuple[int, int], gpu: Optional[str] = None) -> Dict[str, str]:
    """What a record must match to be used by a build with ``toolchain`` (``codegen.bundle.toolchain``)."""
    return {
        "compute_capability": f"{capability[0]}.{capability[1]}",
        "tvm": toolchain["apache-tvm"],
        "tvm_ffi": toolchain["apache-tvm-ffi"],
        "cuda": cuda_release(toolchain["nvcc"]),
        "gpu": gpu,
    }


class DatabaseError(ValueError):
    """A tuning database file that cannot be read as one."""


def bucket_of(rows: int) -> Optional[int]:
    """The max_rows of the bucket that holds M = ``rows``."""
    for max_rows, _ in ROW_BUCKETS:
        if max_rows is None or rows <= max_rows:
            return max_rows
    raise AssertionError("the last bucket is open-ended")


def bucket_score(microseconds: Dict[int, float], max_rows: Optional[int]) -> float:
    """Geometric mean time over the bucket's timed M values (NaN if any is missing)."""
    timed = dict(ROW_BUCKETS)[max_rows]
    values = [microseconds.get(rows, math.nan) for rows in timed]
    return math.exp(sum(math.log(value) for value in values) / len(values)) if all(v > 0 for v in values) else math.nan


@dataclasses.dataclass(frozen=True)
class Record:
    spec: str
    max_rows: Optional[int]
    rule: str
    knobs: Dict[str, int]
    #: The bucket score (``bucket_score``) of this schedule and of the hand-picked one, same run.
    microseconds: float
    default_microseconds: float
    target: Dict[str, str]
    #: ``codegen.lower.kernel_digest`` of the kernel measured: the build recomputes it.
    kernel_digest: str

    def key(self) -> Tuple[str, Optional[int]]:
        return self.spec, self.max_rows

    def describe(self) -> str:
        return f"{self.spec} M<={'any' if self.max_rows is None else self.max_rows} on {self.target.get('gpu')}"

    def malformed(self) -> Optional[str]:
        """Which field has a type no record can have (as read from JSON), and what it needs; or None.
        Values of the right type are judged where they are used: knobs by the rule's ``check``."""
        try:
            spec_parses = isinstance(self.spec, str) and VariantSpec.parse(self.spec) is not None
        except ValueError:
            spec_parses = False
        needs = {
            "spec": (spec_parses, "a variant name such as bf16_k4096_g128_col_fp32"),
            "max_rows": (self.max_rows is None or type(self.max_rows) is int, "an integer or null"),
            "rule": (isinstance(self.rule, str), "a rule name"),
            "knobs": (isinstance(self.knobs, dict) and all(type(v) is int for v in self.knobs.values()), "an object of integers"),
            "microseconds": (type(self.microseconds) in (int, float), "a number"),
            "default_microseconds": (type(self.default_microseconds) in (int, float), "a number"),
            "target": (isinstance(self.target, dict) and all(isinstance(v, str) for v in self.target.values()), "an object of strings"),
            "kernel_digest": (isinstance(self.kernel_digest, str), "a string"),
        }
        wrong = [f"{name}={getattr(self, name)!r} (needs {what})" for name, (ok, what) in needs.items() if not ok]
        return ", ".join(wrong) or None

    def mismatch(self, build_target: Dict[str, str], kernel_digest: Optional[Callable[[VariantSpec, str, Knobs], str]] = None) -> Optional[str]:
        """Why this record cannot be used by a build for ``build_target``, or None.
        ``kernel_digest(spec, rule, knobs)`` is the build's digest of the kernel the record names."""
        buckets = [max_rows for max_rows, _ in ROW_BUCKETS]
        if self.max_rows not in buckets:
            return f"max_rows={self.max_rows!r} is not an M bucket of this code (ROW_BUCKETS: {buckets}); re-tune it"
        for field in MATCHED_FIELDS + (("gpu",) if build_target.get("gpu") else ()):
            if str(self.target.get(field)) != str(build_target[field]):
                return f"measured with {field}={self.target.get(field)!r}, the build has {build_target[field]!r}"
        spec = VariantSpec.parse(self.spec)
        major, minor = (int(part) for part in build_target["compute_capability"].split("."))
        try:
            target = for_capability((major, minor), tuple(TARGETS))
            rule_by_name(self.rule).validate(spec, self.knobs, target)
        except ValueError as error:
            return str(error)
        if kernel_digest is not None:
            current = kernel_digest(spec, self.rule, self.knobs)
            if current != self.kernel_digest:
                return (f"measured on another kernel (digest {self.kernel_digest}; this code makes {current}): "
                        f"the tensor expression or rule {self.rule!r} changed since, so re-tune it")
        return None


@dataclasses.dataclass
class TuningDatabase:
    records: List[Record]
    path: Optional[Path] = None

    @classmethod
    def load(cls, path: Path) -> "TuningDatabase":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise DatabaseError(f"tuning database {path} does not exist; pass an existing file or --no-tuning") from None
        except IsADirectoryError:
            raise DatabaseError(f"tuning database {path} is a folder; pass a file such as {path / DEFAULT_DATABASE.name}") from None
        except (OSError, UnicodeDecodeError) as error:
            raise DatabaseError(f"tuning database {path} cannot be read: {error}") from None
        except json.JSONDecodeError as error:
            raise DatabaseError(f"tuning database {path} is not valid JSON: {error}") from None
        if not isinstance(raw, dict) or raw.get("schema_version") != SCHEMA_VERSION:
            raise DatabaseError(f"tuning database {path}: schema_version={raw.get('schema_version') if isinstance(raw, dict) else None!r}, expected {SCHEMA_VERSION}")
        try:
            records = [Record(**item) for item in raw["records"]]
        except (KeyError, TypeError) as error:
            raise DatabaseError(f"tuning database {path}: a record is malformed ({error}); fields are {[f.name for f in dataclasses.fields(Record)]}") from None
        for index, record in enumerate(records):
            problem = record.malformed()
            if problem is not None:
                raise DatabaseError(f"tuning database {path}: record {index} ({record.spec!r}, max_rows={record.max_rows!r}) has {problem}")
        return cls(records, path)

    def save(self, path: Path) -> None:
        """Write atomically, records sorted, so the committed file diffs cleanly."""
        path = Path(path)
        ordered = sorted(self.records, key=lambda r: (r.spec, math.inf if r.max_rows is None else r.max_rows))
        body = json.dumps({"schema_version": SCHEMA_VERSION, "records": [dataclasses.asdict(r) for r in ordered]}, indent=1, sort_keys=True)
        staged = path.with_name(f".{path.name}.tmp")
        try:
            staged.write_text(body + "\n")
            staged.replace(path)
        except OSError as error:
            raise DatabaseError(f"tuning database {path} cannot be written: {error}") from None

    def merged(self, new: Sequence[Record]) -> "TuningDatabase":
        """This database with ``new`` replacing records of the same (spec, bucket, GPU)."""
        replaced = {(r.spec, r.max_rows, r.target.get("gpu")) for r in new}
        kept = [r for r in self.records if (r.spec, r.max_rows, r.target.get("gpu")) not in replaced]
        return TuningDatabase(kept + list(new), self.path)

    def for_build(self, build_target: Dict[str, str], spec_names: Optional[Sequence[str]] = None,
                  kernel_digest: Optional[Callable[[VariantSpec, str, Knobs], str]] = None) -> Tuple["TunedSchedules", List[str]]:
        """The records this build may use, and one line per rejected record saying why
        (only records of ``spec_names``, where given: the specs being built).

        A (spec, M bucket) that more than one record matches gets none of them, each rejected
        naming the GPUs: which measurement applies is the user's to say (``--tuning-gpu``), since
        a schedule fastest on one GPU is no evidence on another, and picking by file order would
        change the build silently whenever a record is added."""
        matching: Dict[Tuple[str, Optional[int]], List[Record]] = {}
        rejected = []
        for record in self.records:
            if spec_names is not None and record.spec not in spec_names:
                continue
            reason = record.mismatch(build_target, kernel_digest)
            if reason is None:
                matching.setdefault(record.key(), []).append(record)
            else:
                rejected.append(f"{record.describe()}: {reason}")
        usable = {}
        for key, records in matching.items():
            if len(records) == 1:
                usable[key] = records[0]
                continue
            gpus = [str(record.target.get("gpu")) for record in records]
            fix = ("pass --tuning-gpu NAME" if len(set(gpus)) > 1 and not build_target.get("gpu")
                   else "keep one record per (spec, M bucket, GPU), as `tune record` does")
            rejected += [f"{record.describe()}: {len(records)} records for this spec and M bucket match this build "
                         f"({', '.join(gpus)}), so none is used: {fix}" for record in records]
        return TunedSchedules(usable), rejected


@dataclasses.dataclass
class TunedSchedules:
    """The build's ``tuned`` step: a spec's schedule per M bucket, from usable records."""

    records: Dict[Tuple[str, Optional[int]], Record]

    def __call__(self, spec: VariantSpec, fallback: Tuple[str, Knobs]) -> List[Tuple[Optional[int], str, Knobs]]:
        """[(max_rows, rule, knobs), ...] ascending, ending with max_rows None; buckets without a
        record take ``fallback``, and neighbours with one schedule merge into the larger bucket."""
        chosen = []
        for max_rows, _ in ROW_BUCKETS:
            record = self.records.get((spec.name, max_rows))
            rule, knobs = (record.rule, dict(record.knobs)) if record else fallback
            if chosen and chosen[-1][1:] == (rule, knobs):
                chosen.pop()
            chosen.append((max_rows, rule, knobs))
        return chosen
