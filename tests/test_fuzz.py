"""Thousands of damaged and tampered packages: each is refused with aotstack's error or runs correctly.

``AOTSTACK_FUZZ_CASES`` sets the number of cases (2,000 by default) and ``AOTSTACK_FUZZ_SEED`` the seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

import aotstack
from tests.conftest import ROOT, run_child
from tests.test_stacked_end_to_end import ORT_THEN_AOTI

CASES = int(os.environ.get("AOTSTACK_FUZZ_CASES", "2000"))
SEED = int(os.environ.get("AOTSTACK_FUZZ_SEED", "11"))


def test_damaged_and_tampered_packages_end_in_aotstack_errors_or_correct_runs(
    lowered_package, lowered_with, tmp_path
):
    packages = {
        "linear": lowered_package("linear")[1],
        "stacked": lowered_with("stacked", *ORT_THEN_AOTI)[1],
        # A library calling custom ops through the proxy executor, and the manifest's list of them.
        "custom_ops": lowered_package("custom_ops")[1],
    }
    work, temporary, cwd = tmp_path / "work", tmp_path / "tmp", tmp_path / "cwd"
    for directory in (work, temporary, cwd):
        directory.mkdir()
    beside_packages = {path.parent: sorted(os.listdir(path.parent)) for path in packages.values()}

    child = subprocess.run(
        [sys.executable, "-m", "tests.fuzz", str(CASES), str(SEED), *(f"{k}={v}" for k, v in packages.items())],
        capture_output=True, text=True, cwd=cwd, timeout=1500, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT), "FUZZ_DIR": str(work), "TMPDIR": str(temporary)},
    )
    last_case = (work / "current.json").read_text() if (work / "current.json").exists() else "none"
    assert child.returncode == 0, f"the fuzzer died (exit {child.returncode}) at {last_case}: {child.stderr[-3000:]}"
    report = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"\nfuzz: {report['cases']} cases, seed {SEED}, peak RSS grew {report['peak_rss_growth_mb']:.0f} MB")
    for kind, counts in report["counts"].items():
        print(f"  {kind:18} " + ", ".join(f"{outcome} {n}" for outcome, n in sorted(counts.items())))

    assert report["bad"] == []
    assert sum(sum(counts.values()) for counts in report["counts"].values()) == CASES
    # Nothing written anywhere but the loads' own library folders and the fuzzer's own files.
    assert os.listdir(cwd) == []
    # onnxruntime writes a session file, .ses, to the temporary directory when it is imported.
    written = [name for name in os.listdir(temporary) if name != ".ses"]
    assert all(name.startswith("aotstack-libraries-") for name in written), written
    assert {path.parent: sorted(os.listdir(path.parent)) for path in packages.values()} == beside_packages
    # The cases reach past the seal: some tampered manifests are refused by what reads them.
    refused_reasons = set(report["counts"].get("manifest resealed", {}))
    assert any(reason.startswith("refused") for reason in refused_reasons)


# A 2.4 MB zip whose one entry inflates to 256 MiB: reading it must not inflate it.
INFLATE = """
import json, resource, sys
import aotstack
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    aotstack.load(sys.argv[1])
    outcome = "loaded"
except aotstack.AotstackError as exc:
    outcome = str(exc)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"outcome": outcome, "growth_mb": (after - before) / 1024}))
"""


def test_an_entry_that_would_inflate_is_refused_without_inflating_it(tmp_path, lowered_package):
    path = tmp_path / "bomb.pt2"
    from tests import tamper

    contents = tamper.entries(lowered_package("linear")[1])
    with zipfile.ZipFile(path, "w") as bomb:
        for name, data in contents.items():
            bomb.writestr("package/" + name, data)
        bomb.writestr("package/data/aotstack/" + "0" * 64, bytes(256 << 20), compress_type=zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 4 << 20
    result = run_child(INFLATE, str(path))
    assert "compressed" in result["outcome"]
    assert result["growth_mb"] < 64


def test_a_manifest_nested_past_the_bound_is_refused_by_name(lowered_package, tmp_path):
    from tests import tamper

    def nest(manifest):
        value = 1.0
        for _ in range(200):
            value = {"list": [value], "tuple": False}
        tamper.op_steps(manifest)[0]["args"] = {"list": [value], "tuple": False}

    source = lowered_package("split", exclude_ops=("aten.sigmoid",))[1]
    with pytest.raises(aotstack.PackageError, match="nested deeper than 32"):
        aotstack.load(tamper.manifest_edited(source, tmp_path / "deep.pt2", nest))
